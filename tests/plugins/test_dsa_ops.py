"""DeepSeek Sparse Attention ops (plugins/dsa_ops.py, the C++ kernels mtp::dsa_* on every instruction set)
against their position-by-position reference (plugins/dsa_reference.py), and the sparse attention against the dense
MLA reference below index_topk."""

from __future__ import annotations

import pytest
import torch

from plugins.dsa_ops import dsa_index_topk, dsa_sparse_attention, index_topk, sparse_attention
from plugins.dsa_reference import dsa_index_topk_ref, dsa_sparse_attention_ref
from plugins.kv_pool import DTYPE_CODES, KVPoolGeometry, allocate_pool, pool_address
from plugins.reference import mla_paged_attention_ref
from tests.plugins.test_cpp_ops import ISAS

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


def _rows(selected: torch.Tensor) -> list[list[int]]:
    return [sorted(r.tolist()) for r in selected]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_index_topk_matches_reference_on_every_isa(isa, dtype):
    """GLM-5's indexer width (128 of a 576-value row: the AVX loops' full chunks) over a pool of `dtype`, the same
    three requests (past TOPK, below it, padded) and a padding row past sum(q_counts)."""
    g = torch.Generator().manual_seed(1)
    geom = KVPoolGeometry(3, 16, BLOCK, 1, 576, DTYPE_CODES[dtype], kv_kind=1)
    pool = allocate_pool(geom)
    pool.copy_(torch.randn(pool.shape, generator=g).to(dtype))
    tables = torch.full((3, 8), -1, dtype=torch.int32)
    tables[0], tables[1, :2] = torch.arange(8, 0, -1), torch.tensor([12, 9])
    t = int(Q_COUNTS.sum()) + 1
    q, weights = torch.randn(t, 4, 128, generator=g), torch.randn(t, 4, generator=g)
    got = index_topk(pool_address(pool), geom, q, weights, Q_COUNTS, KV_LENS, tables, 2, TOPK, 128**-0.5)
    want = dsa_index_topk_ref(pool, q, weights, Q_COUNTS, KV_LENS, tables, 2, TOPK, 128**-0.5)
    assert _rows(got) == _rows(want) and (got[-1] == -1).all()
    assert _rows(got) == _rows(dsa_index_topk(pool, q, weights, Q_COUNTS, KV_LENS, tables, 2, TOPK, 128**-0.5))


def test_cpp_index_topk_bad_input_is_one_line():
    geom = KVPoolGeometry(1, 4, BLOCK, 1, 16, 0, kv_kind=1)
    pool = allocate_pool(geom)
    q, tables = torch.zeros(2, 2, 8), torch.tensor([[1, 2]], dtype=torch.int32)
    args = (torch.tensor([2], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), tables, pool_address(pool), 0,
            1, 4, BLOCK, 16, 0, 4, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match=r"weights must be \[T, heads\] = \[2, 2\], got \(2, 3\)"):
        torch.ops.mtp.dsa_index_topk(q, torch.zeros(2, 3), *args)
    with pytest.raises(ValueError, match="need more than the 2 block-table columns"):
        torch.ops.mtp.dsa_index_topk(q, torch.zeros(2, 2), args[0], torch.tensor([9], dtype=torch.int32), *args[2:])


@pytest.mark.parametrize("op", ["dsa_index_topk", "dsa_sparse_attention"])
def test_the_cpu_kernel_is_the_cpp_library(op):
    dump = torch._C._dispatch_dump(f"mtp::{op}")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and f"plugins/csrc/{op}.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("q_dtype, pool_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_cpp_sparse_attention_matches_reference_on_every_isa(isa, q_dtype, pool_dtype):
    """GLM-5's latent width (64 rope + 512 c_kv) and 4 heads; rows past TOPK, below it (some slots -1), a padded
    request and a padding row past sum(q_counts)."""
    g = torch.Generator().manual_seed(2)
    geom = KVPoolGeometry(2, 16, BLOCK, 1, 576, DTYPE_CODES[pool_dtype], kv_kind=1)
    pool = allocate_pool(geom)
    pool.copy_(torch.randn(pool.shape, generator=g).to(pool_dtype))
    tables = torch.full((3, 8), -1, dtype=torch.int32)
    tables[0], tables[1, :2] = torch.arange(8, 0, -1), torch.tensor([12, 9])
    t = int(Q_COUNTS.sum()) + 1
    keys = torch.randn(t, 4, 128, generator=g), torch.randn(t, 4, generator=g)
    selected = index_topk(pool_address(pool), geom, *keys, Q_COUNTS, KV_LENS, tables, 1, TOPK, 0.1)
    q = torch.randn(t, 4, 576, generator=g).to(q_dtype)
    got = sparse_attention(pool_address(pool), geom, q, Q_COUNTS, tables, selected, 0, 64, 0.05)
    want = dsa_sparse_attention_ref(pool, q, Q_COUNTS, tables, selected, 0, 64, 0.05)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got.dtype == q_dtype and not got[-1].any()


def test_cpp_sparse_attention_bad_input_is_one_line():
    geom = KVPoolGeometry(1, 4, BLOCK, 1, 16, 0, kv_kind=1)
    pool = allocate_pool(geom)
    q, tables = torch.zeros(1, 2, 16), torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="selects position 9 whose block is not in request 0's block table"):
        sparse_attention(pool_address(pool), geom, q, torch.tensor([1], dtype=torch.int32), tables,
                         torch.tensor([[0, 9]]), 0, 4, 0.1)  # fmt: skip


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_cpp_sparse_attention_below_topk_is_the_dense_kernel_bit_for_bit(isa):
    """A request below index_topk selects every visible position (ascending): its rows must equal
    mtp::mla_paged_attention exactly, so the model's per-forward dense / sparse switch (models/dsa.py) cannot make a
    request's result depend on the rest of its batch."""
    g = torch.Generator().manual_seed(3)
    geom = KVPoolGeometry(2, 16, BLOCK, 1, 576, 0, kv_kind=1)
    pool = allocate_pool(geom)
    pool.copy_(torch.randn(pool.shape, generator=g))
    tables = torch.full((3, 8), -1, dtype=torch.int32)
    tables[0], tables[1, :2] = torch.arange(8, 0, -1), torch.tensor([12, 9])
    counts, lens = torch.tensor([0, 5, 0], dtype=torch.int32), torch.tensor([0, 5, 0], dtype=torch.int32)
    t = 5
    keys = torch.randn(t, 4, 128, generator=g), torch.randn(t, 4, generator=g)
    selected = index_topk(pool_address(pool), geom, *keys, counts, lens, tables, 1, TOPK, 0.1)
    assert selected[4, :5].tolist() == [0, 1, 2, 3, 4], "every visible position, ascending"
    q = torch.randn(t, 16, 576, generator=g)
    got = sparse_attention(pool_address(pool), geom, q, counts, tables, selected, 0, 64, 0.05)
    dense = torch.ops.mtp.mla_paged_attention(q, counts, lens, tables, pool_address(pool), torch.zeros(1, dtype=torch.int64),
                                              0, 2, 16, BLOCK, 576, 0, 64, 0.05)  # fmt: skip
    assert torch.equal(got, dense)
