"""Which weights a compiled package stores (builder/compile_aoti.py `choose_weights`): bf16 while the rank's
weights fit in the last-level cache, fp32 beyond it (the per-step upcast copy from DRAM cost 4.7x at 1.65 GB)."""

from __future__ import annotations

from builder.compile_aoti import choose_weights, last_level_cache_bytes, model_weights
from models.testing import random_model, tiny_config

MiB = 1 << 20


def test_bf16_while_the_weights_fit_in_the_cache():
    assert choose_weights(22 * MiB, 32 * MiB) == "checkpoint"
    assert choose_weights(32 * MiB, 32 * MiB) == "checkpoint"
    assert choose_weights(32 * MiB + 1, 32 * MiB) == "float32"
    assert choose_weights(1650 * MiB, 480 * MiB) == "float32"
    assert choose_weights(1650 * MiB, 0) == "checkpoint"  # cache size unknown: keep the checkpoint's precision


def test_last_level_cache_is_the_highest_level_linux_reports(tmp_path):
    for i, (level, size) in enumerate([(1, "48K"), (1, "64K"), (2, "2048K"), (3, "32768K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 32 * MiB
    (tmp_path / "index3" / "size").write_text("garbage\n")  # an unreadable entry is skipped
    assert last_level_cache_bytes(tmp_path) == 2 * MiB
    assert last_level_cache_bytes(tmp_path / "missing") == 0


def test_a_tiny_model_keeps_bf16_weights():
    assert model_weights(random_model(tiny_config())) == "checkpoint"
