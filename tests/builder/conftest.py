"""Module-shared tiny checkpoints and engines (one build per module: exports are the slow part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder import cli
from builder.options import BuildOptions
from models.testing import make_checkpoint, tiny_config

# Small limits so profiles and pools stay tiny; K=2 < block size 4.
LIMITS = dict(max_batch=4, max_num_tokens=32, max_seq_len=64, kv_block_size=4, num_draft_tokens=2)


def tiny_opts(ckpt: Path, out: Path, **kw) -> BuildOptions:
    return BuildOptions(checkpoint=ckpt, output=out, **{**LIMITS, **kw})


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(path, tiny_config(), seed=3)
    (path / "tokenizer.json").write_text('{"version": "1.0"}\n')  # stands in for a real tokenizer file
    return path


@pytest.fixture(scope="package")
def engine(checkpoint, tmp_path_factory) -> Path:
    """Built through the CLI entry point (`mtp-build`), so its argument handling and rich output run too."""
    out = tmp_path_factory.mktemp("eng") / "engine"
    argv = ["--checkpoint", str(checkpoint), "--output", str(out)]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0
    return out
