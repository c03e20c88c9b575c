"""The fused draft loop (builder/fused_draft.py) is K calls of the draft graph with the host argmax between them, the
rows shrinking as they reach their k_i (runtime/core/draft_loop.py): the same drafts and the same MTP-plane KV writes
but in the null block, in torch eager (no compile; tests/builder/test_fused_draft_engine.py runs the package)."""

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


def _pool(geom):
    pool = allocate_pool(geom)
    pool.normal_(generator=torch.Generator().manual_seed(0))  # history the depths attend to
    return pool


def _per_depth(model, geom, pool, k_i, shift=0):
    """draft_loop.py's argmax path: one draft-graph call per depth on the rows with k_i > d, numpy argmax on the
    host. shift: a planted bug (depth d writes at base-1+d+shift), to show the comparison would see it."""
    hidden, tokens, positions, counts, tables = _inputs(model.cfg)
    draft = wrapper("mtp_draft", model, geom, None)
    drafts: list[list[int]] = [[] for _ in k_i]
    rows = list(range(len(k_i)))
    for d in range(K):
        keep = [n for n, j in enumerate(rows) if k_i[j] > d]
        rows, hidden, tokens = [rows[n] for n in keep], hidden[keep], tokens[keep]
        hidden, logits = draft(hidden, tokens, positions[rows] + d + shift, counts[rows], tables[rows],
                               pool_address(pool))  # fmt: skip
        tokens = torch.from_numpy(logits.numpy().argmax(axis=1))
        for j, t in zip(rows, tokens.tolist(), strict=True):
            drafts[j].append(t)
    return drafts


def _fused(model, geom, pool, k_i):
    with torch.no_grad():
        out = FusedDraftGraph(model, geom, [0] * K)(*_inputs(model.cfg), torch.tensor(k_i), pool_address(pool))
    assert out.dtype == torch.int64 and out.shape == (3, K)
    return [row[:n] for row, n in zip(out.tolist(), k_i, strict=True)]


def test_fused_draft_equals_per_depth_calls():
    cfg, model = cached_model()
    geom = KVPoolGeometry(model.num_kv_planes, 32, 4, cfg.num_key_value_heads, cfg.head_dim)
    ours, theirs, shifted = _pool(geom), _pool(geom), _pool(geom)
    with torch.no_grad():
        want = _per_depth(model, geom, theirs, [K] * 3)
        _per_depth(model, geom, shifted, [K] * 3, shift=1)
    assert _fused(model, geom, ours, [K] * 3) == want
    assert torch.equal(ours, theirs), "the fused depths wrote other MTP-plane KV than the per-depth calls"
    assert not torch.equal(ours, shifted)  # an off-by-one depth position changes the pool: the check above sees it


def test_rows_past_their_depth_write_only_the_null_block():
    """k_i = 2, 0, 3: each row's first k_i drafts are the per-depth loop's, and the pool is the same outside block 0
    (the null block, where a row past its k_i writes); the per-depth loop never touches block 0."""
    cfg, model = cached_model()
    geom = KVPoolGeometry(model.num_kv_planes, 32, 4, cfg.num_key_value_heads, cfg.head_dim)
    ours, theirs, initial = _pool(geom), _pool(geom), _pool(geom)
    k_i = [2, 0, 3]
    with torch.no_grad():
        want = _per_depth(model, geom, theirs, k_i)
    assert [len(d) for d in want] == k_i and _fused(model, geom, ours, k_i) == want
    assert torch.equal(theirs[:, :, 0], initial[:, :, 0]) and not torch.equal(ours[:, :, 0], initial[:, :, 0])
    written = (ours != initial).flatten(4).any(-1)[:, :, 1:]  # [plane, k/v, block, slot]: the same slots written
    assert torch.equal(written, (theirs != initial).flatten(4).any(-1)[:, :, 1:])
    np.testing.assert_allclose(ours[:, :, 1:].numpy(), theirs[:, :, 1:].numpy(), rtol=0, atol=1e-5)
