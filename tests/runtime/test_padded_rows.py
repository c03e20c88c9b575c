"""Invariant 10 on CPU: the bucket padding that captured execution (CUDA graphs) uses is a no-op.

Padded draft rows (count 0, block table -1) and padded verify requests (q_count 0) must leave the live
rows' outputs and every KV plane exactly as the unpadded forward does. (The graph capture itself needs a
GPU: runtime/bench/gpu_check.py.)
"""

from __future__ import annotations

import torch

from models.layers import PagedKV, StepMeta
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from tests.runtime.engine_utils import cached_model


def fresh_kv(model, seed=0):
    cfg = model.cfg
    geom = KVPoolGeometry(model.num_kv_planes, 32, 4, cfg.num_key_value_heads, cfg.head_dim)
    pool = allocate_pool(geom)
    pool.normal_(generator=torch.Generator().manual_seed(seed))  # history the forwards attend to
    return pool, PagedKV(pool_address(pool), geom)


def assert_only_live_blocks_written(pool_a, pool_b, live_tables):
    """Live blocks hold the same values (batched matmuls may round differently); every other block, the null
    block 0 included, is bit-for-bit the untouched initial pool."""
    initial, _ = fresh_kv(cached_model()[1])
    live = sorted({int(b) for b in live_tables.flatten() if b >= 0})
    others = [b for b in range(pool_a.shape[2]) if b not in live]
    torch.testing.assert_close(pool_b[:, :, live], pool_a[:, :, live], rtol=0, atol=1e-5)
    assert torch.equal(pool_b[:, :, others], initial[:, :, others]), "a padded row wrote KV"


def test_padded_draft_rows_are_noops():
    cfg, model = cached_model()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, cfg.hidden_size, generator=g)
    tokens, positions = torch.tensor([5, 9, 14]), torch.tensor([6, 2, 9])
    tables = torch.tensor([[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, 8, -1]], dtype=torch.int32)
    ones = torch.ones(3, dtype=torch.int32)
    pool_a, kv_a = fresh_kv(model)
    pool_b, kv_b = fresh_kv(model)
    with torch.no_grad():
        h_a, logits_a = model.forward_draft(hidden, tokens, positions, ones, tables, kv_a)
        pad = 5  # bucket 8 for 3 live rows
        h_b, logits_b = model.forward_draft(
            torch.cat([hidden, torch.zeros(pad, cfg.hidden_size)]), torch.cat([tokens, torch.zeros(pad, dtype=torch.long)]),
            torch.cat([positions, torch.zeros(pad, dtype=torch.long)]), torch.cat([ones, torch.zeros(pad, dtype=torch.int32)]),
            torch.cat([tables, torch.full((pad, 4), -1, dtype=torch.int32)]), kv_b)  # fmt: skip
    torch.testing.assert_close(h_b[:3], h_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits_b[:3], logits_a, rtol=0, atol=1e-6)
    assert_only_live_blocks_written(pool_a, pool_b, tables)


def test_padded_verify_requests_are_noops():
    cfg, model = cached_model()
    k1 = 3  # decode rows of 1 + k tokens
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2 * k1,), generator=g)
    positions = torch.cat([torch.arange(5, 5 + k1), torch.arange(9, 9 + k1)])
    q_counts = torch.tensor([k1, k1], dtype=torch.int32)
    kv_lens = torch.tensor([5 + k1, 9 + k1], dtype=torch.int32)
    tables = torch.tensor([[1, 2, 3, -1], [4, 5, 6, -1]], dtype=torch.int32)
    pool_a, kv_a = fresh_kv(model)
    pool_b, kv_b = fresh_kv(model)
    with torch.no_grad():
        h_a = model.forward_main(ids, StepMeta(positions, q_counts, kv_lens, tables), kv_a)
        pad_req, pad_rows = 2, 2 * k1  # bucket of 4 requests
        meta_b = StepMeta(torch.cat([positions, torch.zeros(pad_rows, dtype=torch.long)]),
                          torch.cat([q_counts, torch.zeros(pad_req, dtype=torch.int32)]),
                          torch.cat([kv_lens, torch.zeros(pad_req, dtype=torch.int32)]),
                          torch.cat([tables, torch.full((pad_req, 4), -1, dtype=torch.int32)]))  # fmt: skip
        h_b = model.forward_main(torch.cat([ids, torch.zeros(pad_rows, dtype=torch.long)]), meta_b, kv_b)
    torch.testing.assert_close(h_b[: 2 * k1], h_a, rtol=0, atol=1e-5)
    assert_only_live_blocks_written(pool_a, pool_b, tables)


def test_static_buffer_bucketing_is_lossless():
    """The captured-execution path (static buffers, power-of-two request buckets, padding, output slicing)
    in its CPU-runnable "eager" mode gives the same tokens as the plain executor; the bucketed path is
    really taken for drafts and decode-only verify steps."""
    from runtime.core.sampling import SamplingParams
    from runtime.executors.torch_executor import TorchExecutor
    from tests.runtime.engine_utils import make_engine, random_prompts

    # 5 requests through 4 slots, finishing at different times: buckets are refilled with fewer live rows
    # than before, so stale rows must be re-padded every call
    prompts = random_prompts((5, 13, 9, 3, 7), seed=4)
    params = SamplingParams(max_tokens=12)
    for k in (0, 3):
        plain = make_engine(k, max_batch=4)
        expected = [o.output_ids for o in plain.generate(prompts, params)]
        bucketed = make_engine(k, max_batch=4)
        cfg, model = cached_model()
        bucketed.executor = TorchExecutor(model, bucketed.cfg.num_blocks, bucketed.cfg.block_size, cuda_graphs="eager",
                                          max_batch=4, num_draft_tokens=k,
                                          max_blocks_per_request=bucketed.cfg.max_blocks_per_request)  # fmt: skip
        assert [o.output_ids for o in bucketed.generate(prompts, params)] == expected
        ex = bucketed.executor
        assert ex.graphed_verify is not None and set(ex.graphed_verify.graphs) & {1, 2, 4}
        if k:
            assert ex.graphed_draft is not None and 4 in ex.graphed_draft.graphs
