"""The tiny model's training corpus: the Python standard library's own source, split by file and tokenized.

Owns the file listing (the stdlib's .py files: no tests, no site-packages, no huge generated files), the
train / held-out split (BY FILE: every 20th file in sorted order is held out, so held-out numbers measure code
the model never saw), the byte-level BPE trained on the train split only, and the encoding of each split into
one EOS-separated token stream. runtime/bench/runners.py reuses the split rule to pick held-out prompts.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from models.training.tokenizer import EOS_TOKEN, train_bpe

HELDOUT_EVERY = 20  # file i is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
MAX_FILE_BYTES = 200_000  # skip huge (mostly generated / table-like) modules: they would dominate the corpus
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "__pycache__"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib's .py files, sorted by relative path (deterministic across runs on one Python install)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel_dirs = p.relative_to(root).parts[:-1]
        if any(d in SKIP_DIRS or d.startswith("test") for d in rel_dirs) or p.name.startswith("test_"):
            continue
        if p.stat().st_size > MAX_FILE_BYTES or p.stat().st_size == 0:
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Split by file (not by token window) so held-out code is genuinely unseen."""
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, heldout


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def encode_documents(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """One long int64 stream: doc0 EOS doc1 EOS ... (EOS marks where a file ends, as at inference)."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class Corpus:
    root: Path  # the stdlib directory the files come from
    train_files: list[Path]
    heldout_files: list[Path]
    tok: Tokenizer  # byte-level BPE trained on the train split only
    eos_id: int
    train_stream: torch.Tensor  # int64 token ids, files separated by EOS
    heldout_stream: torch.Tensor

    def report(self) -> dict:
        """The "corpus" section of training_report.json (key order is the file's order)."""
        return {
            "source": "Python standard library .py files (sysconfig stdlib path)",
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "heldout_rule": f"file index % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1} in sorted order",
            "heldout_paths": [f.relative_to(self.root).as_posix() for f in self.heldout_files],
            "train_tokens": len(self.train_stream),
            "heldout_tokens": len(self.heldout_stream),
        }


def prepare_corpus(vocab_size: int) -> Corpus:
    """List and split the stdlib files, train the tokenizer on the train split, encode both splits."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = split_files(stdlib_files(root))
    train_texts = [read_source(f) for f in train_files]
    heldout_texts = [read_source(f) for f in heldout_files]
    print(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files from {root}")

    tok = train_bpe(train_texts, vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id is not None, f"{EOS_TOKEN} must be in the vocabulary (it is a special token)"
    train_stream = encode_documents(tok, train_texts, eos_id)
    heldout_stream = encode_documents(tok, heldout_texts, eos_id)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_stream):,} train / {len(heldout_stream):,} held-out tokens"
    )
    return Corpus(root, train_files, heldout_files, tok, eos_id, train_stream, heldout_stream)
