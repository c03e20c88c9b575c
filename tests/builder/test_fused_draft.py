"""The fused draft loop (builder/fused_draft.py) is K calls of the draft graph with the host argmax between them:
the same drafts, the same last hidden and the same MTP-plane KV writes, in torch eager (no compile)."""

from __future__ import annotations

import numpy as np
import torch

from builder.fused_draft import FusedDraftGraph
from builder.graphs import wrapper
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from tests.runtime.engine_utils import cached_model

K = 3


def _inputs(cfg):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, cfg.hidden_size, generator=g)
    tokens = torch.tensor([5, 9, 14])
    positions = torch.tensor([6, 2, 9])  # depth 0's: base-1; depth d writes positions + d
    tables = torch.tensor([[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, 8, -1]], dtype=torch.int32)
    return hidden, tokens, positions, torch.ones(3, dtype=torch.int32), tables


def _pool(model, geom):
    pool = allocate_pool(geom)
    pool.normal_(generator=torch.Generator().manual_seed(0))  # history the depths attend to
    return pool


def _per_depth(model, geom, pool, shift=0):
    """runtime/core/draft_loop.py's argmax path: one draft-graph call per depth, numpy argmax on the host.
    shift: a planted bug (depth d writes at base-1+d+shift), to show the comparison would see it."""
    hidden, tokens, positions, counts, tables = _inputs(model.cfg)
    draft = wrapper("mtp_draft", model, geom, None)
    drafts = []
    for d in range(K):
        hidden, logits = draft(hidden, tokens, positions + d + shift, counts, tables, pool_address(pool))
        tokens = torch.from_numpy(logits.numpy().argmax(axis=1))
        drafts.append(tokens.tolist())
    return np.array(drafts).T, hidden


def test_fused_draft_equals_per_depth_calls():
    cfg, model = cached_model()
    geom = KVPoolGeometry(model.num_kv_planes, 32, 4, cfg.num_key_value_heads, cfg.head_dim)
    ours, theirs, shifted = _pool(model, geom), _pool(model, geom), _pool(model, geom)
    with torch.no_grad():
        drafts, hidden = FusedDraftGraph(model, geom, [0] * K)(*_inputs(cfg), pool_address(ours))
        want, want_hidden = _per_depth(model, geom, theirs)
        _per_depth(model, geom, shifted, shift=1)
    assert drafts.dtype == torch.int64 and drafts.shape == (3, K)
    np.testing.assert_array_equal(drafts.numpy(), want)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(ours, theirs), "the fused depths wrote other MTP-plane KV than the per-depth calls"
    assert not torch.equal(ours, shifted)  # an off-by-one depth position changes the pool: the check above sees it
