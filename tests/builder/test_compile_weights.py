"""Which weights a compiled package stores (builder/compile_aoti.py `choose_weights`): bf16 unless the weights a
graph would still upcast per step (those no bf16-reading op serves) overflow the last-level cache (a per-step
upcast copy from DRAM cost 4.7x at 1.65 GB). The dense linears read bf16 through mtp::linear_bf16, so a GLM-shaped
graph upcasts nothing and stays bf16 at every size."""

from __future__ import annotations

from builder.compile_aoti import choose_weights, last_level_cache_bytes, model_weights
from models.testing import random_model, tiny_config

MiB = 1 << 20


def test_bf16_unless_the_upcast_weights_overflow_the_cache():
    assert choose_weights(0, 32 * MiB) == "checkpoint"  # every weight read as bf16 by an op: any model size
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


def test_bf16_storage_is_tried_when_some_matrix_holds_bf16_numbers():
    import torch

    model = random_model(tiny_config())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    assert model_weights(model) == "checkpoint"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4)  # no longer bf16 numbers
    assert model_weights(model) == "float32"
