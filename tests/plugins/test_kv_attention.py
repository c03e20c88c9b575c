"""KV write and paged attention: the CPU torch ops and the Triton kernels (TRITON_INTERPRET=1, CPU) vs the
reference in plugins/reference.py, on hypothesis-generated batches; plus the poison test (no stray writes)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton / plugins.triton_kernels

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import plugins.ops  # noqa: F401
from plugins.kv_pool import pool_address
from plugins.reference import kv_write_ref, paged_attention_ref
from tests.plugins.cases import Case, cases, filled_pool, tolerance

triton_kernels = pytest.importorskip("plugins.triton_kernels")
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _torch_write(pool: torch.Tensor, c: Case) -> int:
    out = torch.ops.mtp.kv_write(c.k, c.v, c.counts, c.starts, c.tables, pool_address(pool), c.plane,
                                 *c.geom.attrs().values(), c.rope_dim, 10000.0)  # fmt: skip
    return int(out[0])


def _triton_write(pool: torch.Tensor, c: Case) -> int:
    out = triton_kernels.kv_write_triton(c.k, c.v, c.counts, c.starts, c.tables, pool.data_ptr(), c.plane, c.geom,
                                         c.rope_dim, 10000.0)  # fmt: skip
    assert out.dtype == torch.int64 and out.shape == (1,)
    return int(out[0])


def _torch_attention(pool: torch.Tensor, c: Case, scale: float) -> torch.Tensor:
    after = torch.zeros(1, dtype=torch.int64)
    return torch.ops.mtp.paged_attention(c.q, c.counts, c.kv_lens, c.tables, pool_address(pool), after, c.plane,
                                         *c.geom.attrs().values(), scale)  # fmt: skip


def _triton_attention(pool: torch.Tensor, c: Case, scale: float) -> torch.Tensor:
    return triton_kernels.paged_attention_triton(c.q, c.counts, c.kv_lens, c.tables, pool.data_ptr(), c.plane,
                                                 c.geom, scale)  # fmt: skip


WRITERS = {"torch_op": _torch_write, "triton": _triton_write}
ATTENTIONS = {"torch_op": _torch_attention, "triton": _triton_attention}


@pytest.mark.parametrize("impl", list(WRITERS))
@SETTINGS
@given(c=cases())
def test_kv_write_matches_reference(impl: str, c: Case) -> None:
    pool = filled_pool(c.geom)
    expected = pool.clone()
    n_ref = kv_write_ref(expected, c.k, c.v, c.counts, c.starts, c.tables, c.plane, c.rope_dim, 10000.0)
    n = WRITERS[impl](pool, c)
    assert n == n_ref
    torch.testing.assert_close(pool.float(), expected.float(), atol=tolerance(c.geom.dtype), rtol=0)


@pytest.mark.parametrize("impl", list(WRITERS))
@SETTINGS
@given(c=cases())
def test_kv_write_touches_only_its_slots(impl: str, c: Case) -> None:
    """Poison: a NaN-filled pool keeps NaN everywhere except the slots the reference writes."""
    pool = torch.full(c.geom.shape, float("nan"), dtype=c.geom.dtype)
    WRITERS[impl](pool, c)
    expected = torch.full_like(pool, float("nan"))
    kv_write_ref(expected, c.k, c.v, c.counts, c.starts, c.tables, c.plane, c.rope_dim, 10000.0)
    assert torch.equal(pool.isnan(), expected.isnan()), "a slot outside the written rows changed (or one was missed)"


@pytest.mark.parametrize("impl", list(ATTENTIONS))
@SETTINGS
@given(c=cases(holes=False))
def test_paged_attention_matches_reference(impl: str, c: Case) -> None:
    pool = filled_pool(c.geom, seed=1)
    scale = c.geom.head_dim**-0.5
    expected = paged_attention_ref(pool, c.q, c.counts, c.kv_lens, c.tables, c.plane, scale)
    out = ATTENTIONS[impl](pool, c, scale)
    assert out.dtype == c.q.dtype and out.shape == c.q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(c.geom.dtype), rtol=0)
    n = int(c.counts.sum())
    assert torch.all(out[n:] == 0), "padding rows must come back as zeros"


def test_triton_write_then_attend_roundtrip() -> None:
    """A write followed by attention over exactly the written keys: the output is a convex mix of V rows."""
    from plugins.kv_pool import KVPoolGeometry, allocate_pool

    geom = KVPoolGeometry(1, 6, 2, 1, 4, 0)
    pool = allocate_pool(geom)
    v = torch.arange(5, dtype=torch.float32)[:, None, None].expand(5, 1, 4).contiguous()
    k = torch.zeros(5, 1, 4)  # equal scores: attention averages the visible values
    counts, starts = torch.tensor([5], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    tables = torch.tensor([[3, 1, 5]], dtype=torch.int32)
    assert int(triton_kernels.kv_write_triton(k, v, counts, starts, tables, pool.data_ptr(), 0, geom)[0]) == 5
    q = torch.randn(5, 1, 4)
    out = triton_kernels.paged_attention_triton(q, counts, counts, tables, pool.data_ptr(), 0, geom, 1.0)
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0]))


def test_launchers_reject_bad_inputs() -> None:
    from plugins.kv_pool import KVPoolGeometry, allocate_pool

    geom = KVPoolGeometry(1, 4, 2, 2, 4, 0)
    pool = allocate_pool(geom)
    one = torch.ones(1, dtype=torch.int32)
    tables = torch.ones(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected"):
        triton_kernels.kv_write_triton(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), one, one, tables,
                                       pool.data_ptr(), 0, geom)  # fmt: skip
    with pytest.raises(ValueError, match="int32/int64"):
        triton_kernels.paged_attention_triton(torch.zeros(1, 2, 4), one.float(), one, tables, pool.data_ptr(), 0,
                                              geom, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        q = torch.zeros(1, 4, 2).transpose(1, 2)
        triton_kernels.paged_attention_triton(q, one, one, tables, pool.data_ptr(), 0, geom, 1.0)
