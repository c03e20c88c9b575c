"""The chained-depth MTP training objective computes exactly what the runtime's draft path computes.

models/training/chained.py trains depth j > 1 of the MTP module in one parallel pass with a custom attention
mask. These tests replay the runtime instead: main forward and commit pass over a real paged KV pool, then
`forward_draft` once per depth, each depth fed the previous depth's output hidden (post shared_head.norm), at
the positions runtime/core/mtp_plan.py uses. Logits must agree with the training forward's at every depth, so the
loss the model is trained on is the loss of the drafts it will actually make.
"""

from __future__ import annotations

import pytest
import torch

from models.layers import PagedKV, StepMeta
from models.testing import random_model, tiny_config
from models.training.chained import chain_mask, chain_matches, chained_forward, chained_losses
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

DEPTHS = 3
N = 14  # tokens per window


def runtime_drafts(model, ids: torch.Tensor, base: int, depths: int) -> list[torch.Tensor]:
    """Draft logits for base position `base` the way the engine makes them (teacher-forced draft tokens)."""
    cfg = model.cfg
    block = 4
    geom = KVPoolGeometry(model.num_kv_planes, 8, block, cfg.num_key_value_heads, cfg.head_dim)
    pool = allocate_pool(geom)
    kv = PagedKV(pool_address(pool), geom)
    table = torch.arange(1, 1 + (N + depths + block - 1) // block, dtype=torch.int32)[None]
    one = torch.tensor([1], dtype=torch.int32)
    n = base  # committed tokens t_0..t_{base-1}; the base token is t_base
    meta = StepMeta(torch.arange(n + 1), torch.tensor([n + 1], dtype=torch.int32),
                    torch.tensor([n + 1], dtype=torch.int32), table)  # fmt: skip
    hidden = model.forward_main(ids[: n + 1], meta, kv)
    if base >= 2:  # commit pass: MTP-plane K/V of positions 0..base-2 from (h_p, t_{p+1})
        model.forward_commit(hidden[: base - 1], ids[1:base], torch.tensor([base - 1], dtype=torch.int32),
                             torch.tensor([0], dtype=torch.int32), table, kv)  # fmt: skip
    h, token, out = hidden[base - 1 : base], ids[base : base + 1], []
    for d in range(depths):  # depth d writes position base-1+d (runtime/core/mtp_plan.py)
        h, logits = model.forward_draft(h, token, torch.tensor([base - 1 + d]), one, table, kv)
        out.append(logits[0])
        token = ids[base + d + 1 : base + d + 2]  # the draft, when accepted, is the true next token
    return out


@pytest.mark.parametrize("case", [dict(), dict(use_qk_norm=True, partial_rotary_factor=1.0)])
def test_chained_training_logits_equal_runtime_draft_loop(case):
    model = random_model(tiny_config(**case), seed=3)
    ids = torch.randint(0, model.cfg.vocab_size, (N,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, train_logits = chained_forward(model, ids[None], DEPTHS)
        for base in (1, 2, 5, N - DEPTHS - 1):
            drafts = runtime_drafts(model, ids, base, DEPTHS)
            for j, got in enumerate(drafts, start=1):
                # training row p = base-1 at depth j (rows at depth j exist for p <= N-j-1)
                torch.testing.assert_close(train_logits[j - 1][0, base - 1], got, atol=1e-4, rtol=1e-4)


def test_depth_one_is_the_deepseek_mtp_row():
    model = random_model(tiny_config(), seed=5)
    ids = torch.randint(0, model.cfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        main, mtp = model.forward_train(ids)
        main2, chained = chained_forward(model, ids, 2)
    torch.testing.assert_close(main2, main)
    torch.testing.assert_close(chained[0], mtp)
    assert chained[1].shape[1] == N - 2


def test_depth_two_is_not_plain_causal_over_chained_rows():
    """Guard against the easy wrong objective: depth-2 rows attending to each other's (chained) K/V."""
    model = random_model(tiny_config(), seed=7)
    ids = torch.randint(0, model.cfg.vocab_size, (N,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, logits = chained_forward(model, ids[None], 2)
        base = N - 4
        got = runtime_drafts(model, ids, base, 2)[1]
    torch.testing.assert_close(logits[1][0, base - 1], got, atol=1e-4, rtol=1e-4)
    mask = chain_mask(3, 4, 3)
    assert mask.tolist() == [
        [True, False, False, False, True, False, False, True, False, False],
        [True, True, False, False, False, True, False, False, True, False],
        [True, True, True, False, False, False, True, False, False, True],
    ]


def test_chained_loss_trains_every_depth_and_reaches_the_trunk():
    model = random_model(tiny_config(), seed=9)
    model.train()
    window = torch.randint(0, model.cfg.vocab_size, (2, N + 1), generator=torch.Generator().manual_seed(10))
    _, ces, main_logits, mtp_logits = chained_losses(model, window, DEPTHS)
    assert len(ces) == DEPTHS and all(torch.isfinite(c) for c in ces)
    ces[2].backward()  # depth 3 alone: its gradient reaches the MTP block and, through h_p, the main layers
    assert model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    matches = chain_matches(main_logits.detach(), [m.detach() for m in mtp_logits])
    assert matches.shape == (DEPTHS, 2, N - DEPTHS)


def test_depths_out_of_range_is_a_clear_error():
    model = random_model(tiny_config(), seed=11)
    with pytest.raises(ValueError, match="depths=0 must be in 1..13"):
        chained_forward(model, torch.zeros(1, N, dtype=torch.long), 0)
