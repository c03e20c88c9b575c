"""Helpers shared by the shipped-model tests (test_tiny_model.py, test_deep_model.py)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from models.glm4_moe import Glm4MoeMTPModel
from models.layers import PagedKV, StepMeta
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

MODELS = Path(__file__).resolve().parents[2] / "models"
SNIPPET = 'def greet(name):\n    """Say hello."""\n    return f"Hello, {name}!"\n\n\nclass Point:\n    x: int = 0\n'


def read_report(path: Path, make_target: str) -> dict:
    report = path / "training_report.json"
    if not report.is_file():
        raise AssertionError(f"{path} is missing or incomplete; run `make {make_target}` to (re)create it")
    return json.loads(report.read_text())


def paged_main_logits(model: Glm4MoeMTPModel, ids: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Main logits of one prompt through the runtime path (forward_main over a real paged KV pool)."""
    n = len(ids)
    cfg = model.cfg
    geom = KVPoolGeometry(model.num_kv_planes, n // block + 2, block, cfg.num_key_value_heads, cfg.head_dim)
    pool = allocate_pool(geom)
    kv = PagedKV(pool_address(pool), geom)
    table = torch.arange(1, 2 + n // block, dtype=torch.int32)[None]
    meta = StepMeta(torch.arange(n), torch.tensor([n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), table)
    with torch.no_grad():
        out = model.compute_logits(model.forward_main(ids, meta, kv))
    del pool
    return out


def heldout_middle_windows(report: dict, tok, n_files: int, window: int) -> list[torch.Tensor]:
    """`window`+1 tokens from the middle of the first held-out files: code, like most of the report's evenly
    spaced windows (file openings are licence headers and module docstrings, which score noticeably lower)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [root / p for p in report["corpus"]["heldout_paths"] if (root / p).is_file()][:n_files]
    out = []
    for p in paths:
        ids = tok.encode(p.read_text(encoding="utf-8", errors="replace")).ids
        start = max(0, len(ids) // 2 - window // 2)
        out.append(torch.tensor(ids[start : start + window + 1]))
    return out
