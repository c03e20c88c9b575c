"""The DeepSeek Sparse Attention Triton kernels (plugins/dsa_triton.py, the CUDA implementation) in the CPU interpreter
(TRITON_INTERPRET=1) against plugins/dsa_reference.py and, for the order of the selection and its ties, the C++ CPU
kernel: a request past index_topk (a subset selected), one below it (every visible position), a padded request and a
padding row; bad input gets a one-line ValueError. No GPU has run these kernels."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton / the kernel modules

import pytest
import torch

import plugins.dsa_ops  # noqa: F401  (defines torch.ops.mtp.dsa_*: the C++ kernels the selection order is held to)
from plugins.dsa_reference import dsa_index_topk_ref, dsa_sparse_attention_ref
from plugins.kv_pool import DTYPE_CODES, KVPoolGeometry, allocate_pool, pool_address
from plugins.reference import mla_paged_attention_ref

dsa_triton = pytest.importorskip("plugins.dsa_triton")

BLOCK, TOPK = 4, 8
# a 5-row chunk over 30 cached positions (past TOPK), a 5-row prefill (below it: at most 5 visible), a padded request
Q_COUNTS, KV_LENS = torch.tensor([5, 5, 0], dtype=torch.int32), torch.tensor([30, 5, 0], dtype=torch.int32)
ROWS = int(Q_COUNTS.sum()) + 1  # and one padding row past sum(q_counts)


def _pool(latent_dim: int, dtype: torch.dtype, seed: int) -> tuple[KVPoolGeometry, torch.Tensor, torch.Tensor]:
    """Plane 0 latents, plane 1 indexer keys; scattered blocks (block 0, the null block, never in a table)."""
    g = torch.Generator().manual_seed(seed)
    geom = KVPoolGeometry(2, 16, BLOCK, 1, latent_dim, DTYPE_CODES[dtype], kv_kind=1)
    pool = allocate_pool(geom)
    pool.copy_(torch.randn(pool.shape, generator=g).to(dtype))
    tables = torch.full((3, 8), -1, dtype=torch.int32)
    tables[0], tables[1, :2] = torch.randperm(15, generator=g)[:8] + 1, torch.tensor([12, 9])
    return geom, pool, tables


def _cpp_topk(pool, geom, q, w, tables, topk=TOPK, scale=0.25) -> torch.Tensor:
    return torch.ops.mtp.dsa_index_topk(q, w, Q_COUNTS, KV_LENS, tables, pool_address(pool), 1,
                                        *geom.attrs().values(), topk, scale)  # fmt: skip


def _triton_topk(pool, geom, q, w, tables, topk=TOPK, scale=0.25) -> torch.Tensor:
    return dsa_triton.dsa_index_topk_triton(q, w, Q_COUNTS, KV_LENS, tables, pool.data_ptr(), 1, geom, topk, scale)


@pytest.mark.parametrize("kernel", ["triton"])  # the CPU interpreter (TRITON_INTERPRET=1, set above)
@pytest.mark.parametrize("heads, dim, latent_dim", [(3, 6, 10), (16, 16, 24)])  # broadcast sums; the tl.dot path
def test_index_topk_matches_reference_and_cpp_order(kernel: str, heads: int, dim: int, latent_dim: int) -> None:
    geom, pool, tables = _pool(latent_dim, torch.bfloat16, seed=heads)
    g = torch.Generator().manual_seed(7)
    q, w = torch.randn(ROWS, heads, dim, generator=g), torch.randn(ROWS, heads, generator=g)
    got = _triton_topk(pool, geom, q, w, tables)
    want = dsa_index_topk_ref(pool, q, w, Q_COUNTS, KV_LENS, tables, 1, TOPK, 0.25)
    assert [sorted(r.tolist()) for r in got] == [sorted(r.tolist()) for r in want]
    assert torch.equal(got, _cpp_topk(pool, geom, q, w, tables)), "ascending positions, -1 last, as the C++ kernel"
    assert (got[:5] >= 0).all() and not torch.equal(got[4], torch.arange(TOPK)), "past TOPK: a subset of 0..29"
    assert got[9].tolist() == [0, 1, 2, 3, 4, -1, -1, -1] and (got[10] == -1).all(), "below TOPK: every position"


@pytest.mark.parametrize("kernel", ["triton"])
def test_index_topk_ties_go_to_the_lower_position(kernel: str) -> None:
    """Indexer keys that repeat tie exactly: the higher scores first, then the lowest positions among the equal ones
    (the C++ kernel's rule), in the same order; a row of 30 positions where only two keys beat a 28-way tie."""
    geom, pool, tables = _pool(10, torch.float32, seed=3)
    q, w = torch.ones(ROWS, 2, 6), torch.ones(ROWS, 2)
    plane = pool[1, 0].view(-1, 10)  # rows by flat slot
    for pos in range(30):
        slot = int(tables[0, pos // BLOCK]) * BLOCK + pos % BLOCK
        plane[slot, :6] = 2.0 if pos in (13, 27) else 0.5
    got = _triton_topk(pool, geom, q, w, tables)
    assert got[4].tolist() == [0, 1, 2, 3, 4, 5, 13, 27]  # row 4 sees 0..29
    assert got[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 13]  # row 0 sees 0..25: position 27 is in its future
    assert torch.equal(got[:5], _cpp_topk(pool, geom, q, w, tables)[:5])


@pytest.mark.parametrize("kernel", ["triton"])
@pytest.mark.parametrize("q_dtype, pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_sparse_attention_matches_reference_and_is_dense_below_topk(kernel: str, q_dtype, pool_dtype) -> None:
    geom, pool, tables = _pool(10, pool_dtype, seed=5)
    g = torch.Generator().manual_seed(8)
    selected = _cpp_topk(pool, geom, torch.randn(ROWS, 3, 6, generator=g), torch.randn(ROWS, 3, generator=g), tables)
    q = torch.randn(ROWS, 3, 10, generator=g).to(q_dtype)
    got = dsa_triton.dsa_sparse_attention_triton(q, Q_COUNTS, selected, tables, pool.data_ptr(), 0, geom, 4, 0.3)
    want = dsa_sparse_attention_ref(pool, q, Q_COUNTS, tables, selected, 0, 4, 0.3)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got.dtype == q_dtype and not got[-1].any(), "the padding row is zeros"
    dense = mla_paged_attention_ref(pool, q, Q_COUNTS, KV_LENS, tables, 0, 4, 0.3)
    torch.testing.assert_close(got[5:10], dense[5:10], atol=tol, rtol=tol)  # below TOPK: every visible position
    assert (got[:5].float() - dense[:5].float()).abs().max() > 1e-2, "past TOPK the selection changes the result"


@pytest.mark.parametrize("kernel", ["triton"])
def test_sparse_attention_dot_path(kernel: str) -> None:
    """16 heads and 16 rope + 32 c_kv values: the tl.dot path (every tile dimension >= 16)."""
    geom, pool, tables = _pool(48, torch.float32, seed=6)
    g = torch.Generator().manual_seed(9)
    selected = _cpp_topk(pool, geom, torch.randn(ROWS, 2, 8, generator=g), torch.randn(ROWS, 2, generator=g), tables)
    q = torch.randn(ROWS, 16, 48, generator=g)
    got = dsa_triton.dsa_sparse_attention_triton(q, Q_COUNTS, selected, tables, pool.data_ptr(), 0, geom, 16, 0.1)
    torch.testing.assert_close(got, dsa_sparse_attention_ref(pool, q, Q_COUNTS, tables, selected, 0, 16, 0.1),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_bad_input_is_one_line() -> None:
    geom, pool, tables = _pool(10, torch.float32, seed=0)
    q, w = torch.zeros(ROWS, 2, 6), torch.zeros(ROWS, 2)
    with pytest.raises(ValueError, match=r"q: expected float32 .* pass q.float\(\)$"):
        dsa_triton.dsa_index_topk_triton(q.half(), w, Q_COUNTS, KV_LENS, tables, pool.data_ptr(), 1, geom, TOPK, 1.0)
    with pytest.raises(ValueError, match=r"weights: expected float32 \[T, heads\] = \[11, 2\], got .* \(11, 3\)"):
        dsa_triton.dsa_index_topk_triton(q, torch.zeros(ROWS, 3), Q_COUNTS, KV_LENS, tables, pool.data_ptr(), 1, geom,
                                         TOPK, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"selected: expected int64 \[T=11, topk\] .* \(a DsaIndexTopk output\)"):
        dsa_triton.dsa_sparse_attention_triton(torch.zeros(ROWS, 2, 10), Q_COUNTS, torch.zeros(ROWS, TOPK, dtype=torch.int32),
                                               tables, pool.data_ptr(), 0, geom, 4, 1.0)  # fmt: skip
