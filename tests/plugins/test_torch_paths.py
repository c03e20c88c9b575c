"""The torch paths next to the C++ kernels: the autograd-able MoE of the training forward (plugins/ops.py
`moe_experts_local`, three strategies) and the model's per-forward RoPE table.

Every MoE strategy (gathered / dense / loop) equals moe_experts_ref, whichever the cost model would pick;
the per-forward RoPE table equals apply_rope exactly.
"""

from __future__ import annotations

import pytest
import torch

import plugins.ops as ops
from plugins.reference import moe_experts_ref
from plugins.rope import apply_rope, rope_table


@pytest.mark.parametrize("strategy", ["gathered", "dense", "loop"])
@pytest.mark.parametrize("tokens,offset", [(1, 0), (3, 0), (9, 0), (4, 2), (0, 0)])
def test_moe_strategies_match_reference(monkeypatch, strategy: str, tokens: int, offset: int) -> None:
    """offset 2: the local slice holds global experts 2..5 of 8; the others' pairs contribute nothing."""
    gen = torch.Generator().manual_seed(tokens + 10 * offset)
    hidden, inter, num_local, top_k = 8, 4, 4, 2
    x = torch.randn(tokens, hidden, generator=gen)
    picks = [torch.randperm(8 if offset else num_local, generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k, generator=gen)
    w_gate_up = torch.randn(num_local, 2 * inter, hidden, generator=gen)
    w_down = torch.randn(num_local, hidden, inter, generator=gen)
    monkeypatch.setattr(ops, "choose_experts_strategy", lambda *a: strategy)
    out = ops.moe_experts_local(x, ids, weights, w_gate_up, w_down, offset)
    ref = moe_experts_ref(x, ids, weights, w_gate_up, w_down, offset)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cost_model_picks_each_strategy() -> None:
    """models/tiny's width (H 256, I 64, 8 experts, top-2): decode gathers, a 16-row verify goes dense,
    prefill loops; experts too big to copy are never gathered."""
    expert = 3 * 64 * 256 * 4
    assert ops.choose_experts_strategy(2, 0, 8, 2, 64, 256, expert) == "gathered"
    assert ops.choose_experts_strategy(32, 8, 8, 2, 64, 256, expert) == "dense"
    assert ops.choose_experts_strategy(256, 8, 8, 2, 64, 256, expert) == "loop"
    assert ops.choose_experts_strategy(8, 8, 160, 8, 1536, 5120, 3 * 1536 * 5120 * 2) == "loop"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope_dim", [4, 16, 32])
def test_rope_table_equals_apply_rope_bit_for_bit(dtype: torch.dtype, rope_dim: int) -> None:
    """The per-forward table (what every layer uses) vs the reference rotation, partial and full rotary."""
    gen = torch.Generator().manual_seed(rope_dim)
    x = torch.randn(9, 3, 32, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (9,), generator=gen)
    expected = apply_rope(x, positions, rope_dim, 10000.0)
    assert torch.equal(rope_table(positions, rope_dim, 32, 10000.0, dtype).apply(x), expected)
