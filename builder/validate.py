"""Build-time checks that refuse what cannot run, before anything is written (pure: they read, never write).

Owns: where `--output` may go (never the checkpoint, never a directory mtp-build did not write), the tokenizer check (loads and fits the vocabulary, or the
engine is ids-only; tokenizer_config.json is JSON and its chat template compiles), and the memory check (the KV pool the limits imply, plus the weights, fits the machine).
The pipeline (builder/pipeline.py) calls them in that order; each raises `BuildError` naming the problem and
the fix. The weight checks are the importer's (models/checkpoint.py): names, dtypes, shapes and FP8 scales from
the shard headers before anything is read, every value finite as each rank reads its share.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.options import BuildError
from models.engine_format import (
    CONFIG_NAME,
    MANIFEST_NAME,
    EngineDirError,
    load_engine_config,
    looks_like_engine_dir,
    manifest_files,
)
from models.tokenizer_config import TokenizerConfigError, check_chat_template, load_tokenizer_file
from plugins.kv_pool import KVPoolGeometry

# Files an engine directory holds besides those its checksum table lists (the tables themselves).
ENGINE_METADATA = (CONFIG_NAME, MANIFEST_NAME)
IDS_ONLY = "ids-only"


def _resolve(path: Path, flag: str) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:  # Python 3.11 raises RuntimeError for a loop, 3.13 OSError
        raise BuildError(f"{flag} {path}: symbolic link loop ({e}); remove the link or choose another path") from e


def check_output(checkpoint: Path, output: Path, force: bool) -> None:
    """Refuse an --output whose replacement could destroy anything but an engine mtp-build wrote."""
    out, ckpt = _resolve(output, "--output"), _resolve(checkpoint, "--checkpoint")
    if out == ckpt:
        raise BuildError(f"--output {output} is the checkpoint directory: building there would delete the "
                         "checkpoint; choose another --output (e.g. engines/NAME)")  # fmt: skip
    if out.is_relative_to(ckpt):
        raise BuildError(f"--output {output} is inside the checkpoint directory {checkpoint}: the build would write "
                         "into the checkpoint; choose an --output outside it (e.g. engines/NAME)")  # fmt: skip
    if ckpt.is_relative_to(out):
        raise BuildError(f"--output {output} contains the checkpoint directory {checkpoint}: replacing it would delete "
                         "the checkpoint; choose another --output (e.g. engines/NAME)")  # fmt: skip
    for parent in output.absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise BuildError(f"--output {output}: its parent {parent} is a file, not a directory; choose another "
                                 "path")  # fmt: skip
            break
    if output.is_symlink():
        raise BuildError(f"--output {output} is a symbolic link (to {out}); give the directory itself or another path")
    if not output.exists():
        return
    if not output.is_dir():
        raise BuildError(f"--output {output} exists and is a file; choose another path or remove it")
    if not any(output.iterdir()):
        return
    if not looks_like_engine_dir(output):
        raise BuildError(
            f"--output {output} exists and was not written by mtp-build (no engine {CONFIG_NAME}); refusing to replace "
            "it, even with --force. Choose another path, or empty it yourself"
        )
    foreign = foreign_files(output)
    if foreign is None:  # an engine's config.json beside a missing or damaged manifest.json
        if not force:
            raise BuildError(f"--output {output} is an engine directory whose {MANIFEST_NAME} is missing or damaged; "
                             "pass --force to replace it, or choose another --output")  # fmt: skip
        return
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise BuildError(f"--output {output} is an engine directory but holds files mtp-build did not write: {shown}; "
                         "a rebuild would delete them: move them out, or choose another --output")  # fmt: skip
    try:
        load_engine_config(output)
    except EngineDirError as e:
        if not force:
            raise BuildError(f"--output {output} is an incomplete engine directory ({e}); pass --force to replace it, "
                             "or choose another --output") from e  # fmt: skip


def foreign_files(engine_dir: Path) -> list[str] | None:
    """Files under an engine directory that neither its manifest nor (schema 1) its config lists, sorted and
    relative; None when neither lists any (a damaged manifest.json): which files are mtp-build's is then unknown."""
    tables = [manifest_files(engine_dir)]
    try:
        raw = json.loads((engine_dir / CONFIG_NAME).read_text())
        tables.append(raw.get("files") if isinstance(raw, dict) else None)
    except (OSError, ValueError):
        pass
    known = [t for t in tables if isinstance(t, dict)]
    if not known:
        return None
    listed = set(ENGINE_METADATA).union(*(map(str, t) for t in known))
    present = (p for p in engine_dir.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(rel for rel in (str(p.relative_to(engine_dir)) for p in present) if rel not in listed)


def check_tokenizer_config(directory: Path) -> None:
    """tokenizer_config.json (copied into the engine) is JSON and its chat template compiles: mtp-serve loads both."""
    try:
        check_chat_template(directory)
    except TokenizerConfigError as e:
        raise BuildError(str(e)) from None


def check_engine_tokenizer(engine_dir: Path, vocab_size: int) -> None:
    """`--check`: the engine's tokenizer.json (when it has one) loads and fits the vocabulary, as mtp-run and
    mtp-serve load it (a resealed or hand-edited one used to pass and then crash their start-up)."""
    try:
        tok = load_tokenizer_file(engine_dir)
    except TokenizerConfigError as e:
        raise BuildError(str(e)) from None
    n = 0 if tok is None else tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise BuildError(f"{engine_dir / 'tokenizer.json'} has {n} tokens but the model's vocab_size is {vocab_size}; "
                         "copy tokenizer.json again from the model's original checkpoint")  # fmt: skip


def check_tokenizer(checkpoint: Path, vocab_size: int) -> str:
    """'tokenizer.json' when it loads and fits the vocabulary; IDS_ONLY when the checkpoint has none."""
    check_tokenizer_config(checkpoint)
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        return IDS_ONLY
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        tok.encode("def main():\n    return 0")
    except Exception as e:  # the tokenizers library raises bare Exception for a bad file
        why = " ".join(str(e).split())[:200]
        raise BuildError(f"tokenizer.json in {checkpoint} does not load ({type(e).__name__}: {why}); fix it, or "
                         "remove it to build an ids-only engine (prompts as token ids)") from e  # fmt: skip
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise BuildError(f"{path} has {n} tokens but the model's vocab_size is {vocab_size}: ids >= {vocab_size} "
                         "would index past the embedding; use the tokenizer this checkpoint was trained with")  # fmt: skip
    return "tokenizer.json"


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """What one rank allocates at run time for the engine's limits (activations are small next to these)."""

    pool_bytes: int  # the KV pool baked into the engine (default_num_blocks blocks)
    weight_bytes: int  # this rank's weights in the build dtype
    bytes_per_request: int  # pool bytes one request at max_seq_len takes
    block_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.weight_bytes


def memory_estimate(geom: KVPoolGeometry, weight_bytes: int, blocks_per_request: int) -> MemoryEstimate:
    block_bytes = geom.nbytes // geom.num_blocks
    return MemoryEstimate(geom.nbytes, weight_bytes, blocks_per_request * block_bytes, block_bytes)


def machine_memory(device: str = "cpu") -> int:
    """Bytes of memory the run may use: host RAM (within a cgroup limit) or, for "cuda", the GPU's."""
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[1])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):  # absent, or "max" (no limit)
            total = min(total, int(Path(limit).read_text().strip()))
    return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_memory(est: MemoryEstimate, available: int, max_batch: int) -> None:
    if est.total_bytes <= available:
        return
    fits = (available - est.weight_bytes - est.block_bytes) // est.bytes_per_request
    fix = f"lower --max-batch to at most {fits} " if fits >= 1 else "even one request does not fit: "
    raise BuildError(
        f"the KV pool needs {_gib(est.pool_bytes)} ({max_batch} requests x {_gib(est.bytes_per_request)} at "
        f"--max-seq-len) plus {_gib(est.weight_bytes)} of weights per rank, but this machine has {_gib(available)}; "
        f"{fix}or lower --max-seq-len"
    )
