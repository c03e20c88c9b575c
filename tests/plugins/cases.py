"""Hypothesis strategies shared by the plugin tests: random paged-KV layouts and batches.

A case holds a pool geometry, per-request segments (counts incl. 0, starts crossing block boundaries),
block tables of distinct random blocks padded with -1, K/V/Q rows with extra padding rows, and a GQA group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from plugins.kv_pool import KVPoolGeometry


@dataclass
class Case:
    geom: KVPoolGeometry
    counts: torch.Tensor  # int32 [R]
    starts: torch.Tensor  # int32 [R]
    tables: torch.Tensor  # int32 [R, max_blocks]
    k: torch.Tensor  # [T + pad, Hkv, D]
    v: torch.Tensor
    q: torch.Tensor  # [T + pad, Hkv * group, D]
    group: int
    plane: int
    rope_dim: int

    @property
    def kv_lens(self) -> torch.Tensor:
        return self.starts + self.counts


@st.composite
def cases(draw, dtypes=(torch.float32, torch.float16, torch.bfloat16), holes: bool = True) -> Case:
    """holes=True may punch -1 entries inside a request's written range (those rows must be no-ops);
    attention cases use holes=False since reading a missing block is outside the contract."""
    dtype = draw(st.sampled_from(dtypes))
    block_size = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    group = draw(st.sampled_from([1, 2, 4]))
    num_requests = draw(st.integers(1, 4))
    counts = draw(st.lists(st.integers(0, 6), min_size=num_requests, max_size=num_requests))
    starts = draw(st.lists(st.integers(0, 9), min_size=num_requests, max_size=num_requests))
    need = [(s + c + block_size - 1) // block_size for s, c in zip(starts, counts, strict=True)]
    max_blocks = max(need) + draw(st.integers(0, 2))
    num_blocks = 1 + sum(need) + draw(st.integers(0, 3))  # block 0 is the null block
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((num_requests, max_blocks), -1, dtype=torch.int32)
    for r, n in enumerate(need):
        for col in range(n):
            tables[r, col] = free.pop()
    if holes and draw(st.booleans()):
        r = draw(st.integers(0, num_requests - 1))
        if need[r]:
            tables[r, draw(st.integers(0, need[r] - 1))] = -1
    planes = draw(st.integers(1, 2))
    rope_dim = draw(st.sampled_from([0, head_dim // 2, head_dim]))
    geom = KVPoolGeometry(planes, num_blocks, block_size, kv_heads, head_dim, {torch.float32: 0, torch.float16: 1,
                                                                               torch.bfloat16: 2}[dtype])  # fmt: skip
    rows = sum(counts) + draw(st.integers(0, 2))  # trailing padding rows
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen).to(dtype)
    return Case(geom, torch.tensor(counts, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), tables,
                k, v, q, group, draw(st.integers(0, planes - 1)), rope_dim)  # fmt: skip


def filled_pool(geom: KVPoolGeometry, seed: int = 0) -> torch.Tensor:
    """A pool of random values (so attention over positions written earlier reads real data)."""
    return torch.randn(geom.shape, generator=torch.Generator().manual_seed(seed)).to(geom.dtype)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
