"""Decode-row time of DeepSeek Sparse Attention's pieces at two contexts and two index_topk values. Not a test
(timings never assert anything).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.plugins.bench_dsa --rounds 5

One layer, one decode row (a request whose context is `ctx` cached positions), GLM-5's attention geometry cut to 16
heads: latent 64 rope + 512 c_kv, indexer 32 heads x 128, block 64. Per case the median over rounds of:
  select  `index_topk` (the C++ kernel mtp::dsa_index_topk, what the model runs on CPU): the indexer scores every
          cached position, then top-k (grows with the context, cheaply: 32 x 128 multiply-adds per position)
  sparse  `sparse_attention` (the C++ kernel mtp::dsa_sparse_attention): absorbed attention over the index_topk
          selected latents (grows with index_topk)
  dense   `mtp::mla_paged_attention` (C++): the same attention over every cached position, for comparison
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

import plugins.mla_ops  # noqa: F401  (torch.ops.mtp.mla_paged_attention)
from plugins.dsa_ops import index_topk, sparse_attention
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

HEADS, ROPE, RANK, IDX_HEADS, IDX_DIM, BLOCK = 16, 64, 512, 32, 128, 64


def _case(ctx: int, gen: torch.Generator):
    blocks = ctx // BLOCK + 1
    geom = KVPoolGeometry(2, blocks, BLOCK, 1, ROPE + RANK, 0, kv_kind=1)  # plane 0: latents, plane 1: indexer keys
    pool = allocate_pool(geom)
    pool.copy_(torch.randn(pool.shape, generator=gen))
    table = torch.arange(1, blocks, dtype=torch.int32)[None]
    q_idx = torch.randn(1, IDX_HEADS, IDX_DIM, generator=gen)
    weights = torch.randn(1, IDX_HEADS, generator=gen)
    q = torch.randn(1, HEADS, ROPE + RANK, generator=gen)
    one, lens = torch.tensor([1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
    return geom, pool, table, q_idx, weights, q, one, lens


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--topks", default="256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}; µs per decode row, median of {args.rounds}")
    print(f"{'context':>8} {'index_topk':>10} {'select':>9} {'sparse':>9} {'dense':>9}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        geom, pool, table, q_idx, weights, q, one, lens = _case(ctx, gen)
        ptr, after = pool_address(pool), torch.zeros(1, dtype=torch.int64)
        dense = _median_us(partial(torch.ops.mtp.mla_paged_attention, q, one, lens, table, ptr, after, 0,
                                   geom.num_planes, geom.num_blocks, BLOCK, ROPE + RANK, 0, ROPE, 0.1), args.rounds)  # fmt: skip
        for topk in (int(k) for k in args.topks.split(",")):
            select_call = partial(index_topk, ptr, geom, q_idx, weights, one, lens, table, 1, topk, IDX_DIM**-0.5)
            sel = select_call()
            select = _median_us(select_call, args.rounds)
            sparse = _median_us(partial(sparse_attention, ptr, geom, q, one, table, sel, 0, ROPE, 0.1), args.rounds)
            print(f"{ctx:>8} {topk:>10} {select:>9.0f} {sparse:>9.0f} {dense:>9.0f}")

if __name__ == "__main__":
    main()
