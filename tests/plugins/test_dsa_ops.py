"""DeepSeek Sparse Attention ops (plugins/dsa_ops.py) against their position-by-position reference
(plugins/dsa_reference.py), and the reference against the dense MLA reference below index_topk."""

from __future__ import annotations

import pytest
import torch

from plugins.dsa_ops import dsa_index_topk, dsa_sparse_attention
from plugins.dsa_reference import dsa_index_topk_ref, dsa_sparse_attention_ref
from plugins.reference import mla_paged_attention_ref

BLOCK, LATENT, ROPE, HEADS, IDX_HEADS, IDX_DIM, TOPK = 4, 10, 4, 3, 4, 6, 8
# three requests: a chunk of 5 rows over 30 cached positions (past TOPK), a 5-row prefill (below it), a padded one
Q_COUNTS, KV_LENS = torch.tensor([5, 5, 0], dtype=torch.int32), torch.tensor([30, 5, 0], dtype=torch.int32)


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 1, 16, BLOCK, 1, LATENT, generator=g)  # plane 0: latents, plane 1: indexer keys
    perm = torch.randperm(15, generator=g) + 1  # scattered blocks, block 0 never used
    tables = torch.full((3, 8), -1, dtype=torch.int32)
    tables[0] = perm[:8].int()
    tables[1, :2] = perm[8:10].int()
    t = int(Q_COUNTS.sum())
    q_idx = torch.randn(t, IDX_HEADS, IDX_DIM, generator=g)
    weights = torch.randn(t, IDX_HEADS, generator=g)
    q = torch.randn(t, HEADS, LATENT, generator=g)
    return pool, tables, q_idx, weights, q


def test_index_topk_matches_reference(case):
    pool, tables, q_idx, weights, _ = case
    got = dsa_index_topk(pool, q_idx, weights, Q_COUNTS, KV_LENS, tables, 1, TOPK, IDX_DIM**-0.5)
    want = dsa_index_topk_ref(pool, q_idx, weights, Q_COUNTS, KV_LENS, tables, 1, TOPK, IDX_DIM**-0.5)
    assert [sorted(r.tolist()) for r in got] == [sorted(r.tolist()) for r in want]
    assert (got[:5] >= 0).all() and (got[:5] <= 29).all(), "rows past TOPK fill every slot with visible positions"
    assert sorted(got[5].tolist()) == [-1] * 7 + [0], "row 0 of a fresh prefill sees position 0 only"
    assert sorted(got[9].tolist()) == [-1] * 3 + [0, 1, 2, 3, 4]


def test_sparse_attention_matches_reference_and_is_dense_below_topk(case):
    pool, tables, q_idx, weights, q = case
    selected = dsa_index_topk(pool, q_idx, weights, Q_COUNTS, KV_LENS, tables, 1, TOPK, IDX_DIM**-0.5)
    got = dsa_sparse_attention(pool, q, Q_COUNTS, tables, selected, 0, ROPE, 0.3)
    torch.testing.assert_close(got, dsa_sparse_attention_ref(pool, q, Q_COUNTS, tables, selected, 0, ROPE, 0.3))
    dense = mla_paged_attention_ref(pool, q, Q_COUNTS, KV_LENS, tables, 0, ROPE, 0.3)
    torch.testing.assert_close(got[5:], dense[5:])  # the request below TOPK: every visible position selected
    assert (got[:5] - dense[:5]).abs().max() > 1e-2, "past TOPK the selection must change the result"
