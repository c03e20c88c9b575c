"""Module-shared tiny checkpoints and engines (one build per module: exports are the slow part)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from builder import cli
from builder.options import BuildOptions
from models.testing import make_checkpoint, tiny_config

# Small limits so profiles and pools stay tiny; K=2 < block size 4.
LIMITS = dict(max_batch=4, max_num_tokens=32, max_seq_len=64, kv_block_size=4, num_draft_tokens=2)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A real (loadable) word-level tokenizer.json with `vocab_size` tokens: the build checks that it loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def tiny_opts(ckpt: Path, out: Path, **kw) -> BuildOptions:
    return BuildOptions(checkpoint=ckpt, output=out, **{**LIMITS, "compile": "none", **kw})


# Session scope (not package): the same lifetime here, and tests/conftest.py's xdist_groups keeps the files that share
# a session build fixture on one worker.
@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(path, tiny_config(), seed=3)
    write_tokenizer(path / "tokenizer.json", 96)
    return path


@pytest.fixture(scope="package")
def engine(checkpoint, tmp_path_factory) -> Path:
    """Built through the CLI entry point (`mtp-build`), so its argument handling and rich output run too."""
    out = tmp_path_factory.mktemp("eng") / "engine"
    argv = ["--checkpoint", str(checkpoint), "--output", str(out), "--compile", "none"]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0
    return out


COMPILED_K = 3  # the shared compiled build's draft depth (< block size 4): the fused draft package needs K >= 2


@pytest.fixture(scope="session")
def compiled_build(checkpoint, tmp_path_factory) -> tuple[Path, str]:
    """(engine dir, what mtp-build printed): the default build (no --compile flag: aoti here) with K=3, shared by
    test_compiled_engine.py and test_fused_draft_engine.py (one AOTInductor build of the tiny checkpoint, ~1 CPU-min)."""
    out = tmp_path_factory.mktemp("compiled") / "engine"
    argv = ["--checkpoint", str(checkpoint), "--output", str(out)]
    for k, v in {**LIMITS, "num_draft_tokens": COMPILED_K}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    capture = io.StringIO()
    with contextlib.redirect_stdout(capture):
        assert cli.main(argv) == 0
    return out, capture.getvalue()


@pytest.fixture(scope="session")
def tp2(tiny_tp2_engine) -> Path:
    """The TP2 (EP2 by default) engine of models/tiny: tests/conftest.py's compiled build, shared with
    tests/runtime/test_mpi_tp.py and test_build_defaults.py (a second TP2 build of another checkpoint cost a minute)."""
    return tiny_tp2_engine
