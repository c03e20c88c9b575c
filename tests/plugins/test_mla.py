"""MLA latent paged KV: the CPU torch ops and the Triton kernels (TRITON_INTERPRET=1, CPU) vs plugins/reference.py
on hypothesis batches, the poison test, absorbed == decompressed MLA attention, the pool geometry, and the ONNX
export + ONNX Runtime path."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton / the kernel modules

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import plugins.mla_ops  # noqa: F401  (defines torch.ops.mtp.mla_*)
from models.engine_format.layout import KVLayout
from plugins.kv_pool import DTYPE_CODES, KVPoolGeometry, allocate_pool, plane_kv, pool_address
from plugins.reference import mla_kv_write_ref, mla_paged_attention_ref
from plugins.rope import apply_rope
from tests.plugins.cases import cases, filled_pool, tolerance

mla_triton = pytest.importorskip("plugins.mla_triton")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class MlaCase:
    geom: KVPoolGeometry  # kv_kind 1
    counts: torch.Tensor
    starts: torch.Tensor
    tables: torch.Tensor
    latent: torch.Tensor  # [T + pad, latent_dim]
    q: torch.Tensor  # [T + pad, H, latent_dim]
    plane: int
    rope_dim: int  # write: rope the first rope_dim dims; attention: values are latent[:, rope_dim:]
    inv_freq: torch.Tensor  # float32 [rope_dim // 2]
    rope_scale: float

    @property
    def kv_lens(self) -> torch.Tensor:
        return self.starts + self.counts


@st.composite
def mla_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16), holes: bool = True) -> MlaCase:
    """The GQA cases' segments and block tables (counts incl. 0, -1 padding, holes), with an MLA latent pool."""
    base = draw(cases(dtypes=dtypes, holes=holes))
    rope_dim = draw(st.sampled_from([0, 2, 4]))
    latent_dim = rope_dim + draw(st.sampled_from([2, 4, 6]))
    heads = draw(st.integers(1, 3))
    g = base.geom
    geom = KVPoolGeometry(g.num_planes, g.num_blocks, g.block_size, 1, latent_dim, g.dtype_code, kv_kind=1)
    act = draw(st.sampled_from([torch.float32, g.dtype]))  # activations may be wider than the pool
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = base.k.shape[0]
    # A non-trivial inv_freq (not theta-derived, so an op using rope_theta would fail) and a YaRN-like scale.
    inv_freq = torch.rand(rope_dim // 2, generator=gen) * 1.5 + 0.05
    return MlaCase(geom, base.counts, base.starts, base.tables, torch.randn(rows, latent_dim, generator=gen).to(act),
                   torch.randn(rows, heads, latent_dim, generator=gen).to(act), base.plane, rope_dim, inv_freq,
                   draw(st.sampled_from([1.0, 0.8, 1.37])))  # fmt: skip


def _torch_write(pool: torch.Tensor, c: MlaCase) -> int:
    out = torch.ops.mtp.mla_kv_write(c.latent, c.counts, c.starts, c.tables, pool_address(pool), c.inv_freq, c.plane,
                                     *c.geom.attrs().values(), c.rope_dim, c.rope_scale)  # fmt: skip
    return int(out[0])


def _triton_write(pool: torch.Tensor, c: MlaCase) -> int:
    out = mla_triton.mla_kv_write_triton(c.latent, c.counts, c.starts, c.tables, pool.data_ptr(), c.inv_freq,
                                         c.plane, c.geom, c.rope_dim, c.rope_scale)  # fmt: skip
    assert out.dtype == torch.int64 and out.shape == (1,)
    return int(out[0])


def _torch_attention(pool: torch.Tensor, c: MlaCase, scale: float) -> torch.Tensor:
    after = torch.zeros(1, dtype=torch.int64)
    return torch.ops.mtp.mla_paged_attention(c.q, c.counts, c.kv_lens, c.tables, pool_address(pool), after, c.plane,
                                             *c.geom.attrs().values(), c.rope_dim, scale)  # fmt: skip


def _triton_attention(pool: torch.Tensor, c: MlaCase, scale: float) -> torch.Tensor:
    return mla_triton.mla_paged_attention_triton(c.q, c.counts, c.kv_lens, c.tables, pool.data_ptr(), c.plane,
                                                 c.geom, c.rope_dim, scale, block_n=4)  # fmt: skip


WRITERS = {"torch_op": _torch_write, "triton": _triton_write}
ATTENTIONS = {"torch_op": _torch_attention, "triton": _triton_attention}


def _ref_write(pool: torch.Tensor, c: MlaCase) -> int:
    return mla_kv_write_ref(pool, c.latent, c.counts, c.starts, c.tables, c.plane, c.inv_freq, c.rope_dim,
                            c.rope_scale)  # fmt: skip


@pytest.mark.parametrize("impl", list(WRITERS))
@SETTINGS
@given(c=mla_cases())
def test_mla_kv_write_matches_reference(impl: str, c: MlaCase) -> None:
    pool = filled_pool(c.geom)
    expected = pool.clone()
    n_ref = _ref_write(expected, c)
    assert WRITERS[impl](pool, c) == n_ref
    torch.testing.assert_close(pool.float(), expected.float(), atol=tolerance(c.geom.dtype), rtol=0)


def _addressed(c: MlaCase) -> torch.Tensor:
    """bool [blocks, B] of the slots the segments store into (valid blocks only), from the metadata alone."""
    hit = torch.zeros(c.geom.num_blocks, c.geom.block_size, dtype=torch.bool)
    for r in range(c.counts.shape[0]):
        for pos in range(int(c.starts[r]), int(c.starts[r]) + int(c.counts[r])):
            col = pos // c.geom.block_size
            if col < c.tables.shape[1] and int(c.tables[r, col]) >= 0:
                hit[int(c.tables[r, col]), pos % c.geom.block_size] = True
    return hit


@pytest.mark.parametrize("impl", list(WRITERS))
@SETTINGS
@given(c=mla_cases())
def test_mla_kv_write_touches_only_its_slots(impl: str, c: MlaCase) -> None:
    """Poison: a sentinel-filled pool stays bit-identical everywhere but the addressed slots of the written plane."""
    sentinel = torch.full(c.geom.shape, float("nan"), dtype=c.geom.dtype)
    pool = sentinel.clone()
    WRITERS[impl](pool, c)
    bits = torch.int32 if c.geom.dtype == torch.float32 else torch.int16
    changed = pool.view(bits) != sentinel.view(bits)  # [planes, 1, blocks, B, 1, latent_dim]
    expected = torch.zeros_like(changed)
    expected[c.plane, 0, :, :, 0, :] = _addressed(c)[:, :, None]
    assert torch.equal(changed, expected), "a slot outside the segments changed, or an addressed one was not written"


@pytest.mark.parametrize("impl", list(ATTENTIONS))
@SETTINGS
@given(c=mla_cases(holes=False))
def test_mla_paged_attention_matches_reference(impl: str, c: MlaCase) -> None:
    pool = filled_pool(c.geom, seed=1)
    scale = c.geom.head_dim**-0.5
    expected = mla_paged_attention_ref(pool, c.q, c.counts, c.kv_lens, c.tables, c.plane, c.rope_dim, scale)
    out = ATTENTIONS[impl](pool, c, scale)
    assert out.dtype == c.q.dtype and out.shape == (c.q.shape[0], c.q.shape[1], c.geom.head_dim - c.rope_dim)
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(c.geom.dtype), rtol=0)
    assert torch.all(out[int(c.counts.sum()) :] == 0), "padding rows must come back as zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_attention_dot_path(dtype: torch.dtype) -> None:
    """Tiles >= 16 take the tl.dot path (the shape of a real model); the small hypothesis shapes do not."""
    geom = KVPoolGeometry(2, 12, 4, 1, 16 + 48, DTYPE_CODES[dtype], kv_kind=1)
    pool = filled_pool(geom, seed=2)
    counts, starts = torch.tensor([5, 1, 0, 3], dtype=torch.int32), torch.tensor([0, 17, 0, 9], dtype=torch.int32)
    tables = torch.tensor([[1, 2, -1, -1, -1], [3, 4, 5, 6, 7], [-1] * 5, [8, 9, 10, -1, -1]], dtype=torch.int32)
    q = torch.randn(10, 20, geom.head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    kv_lens = starts + counts
    ref = mla_paged_attention_ref(pool, q, counts, kv_lens, tables, 1, 16, 0.11)
    out = mla_triton.mla_paged_attention_triton(q, counts, kv_lens, tables, pool.data_ptr(), 1, geom, 16, 0.11,
                                                block_n=16)  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance(dtype), rtol=0)


def _inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim)


@pytest.mark.parametrize("seed, rope_scale", [(0, 1.0), (1, 1.2), (2, 0.9)])
def test_absorbed_attention_equals_decompressed_mla(seed: int, rope_scale: float) -> None:
    """The absorbed form (q_nope @ W_UK against the cached latent, then W_UV) equals plain per-head MLA attention
    with K and V decompressed from the latent, within 1e-5 in fp32: the proof that caching the latent is exact."""
    gen = torch.Generator().manual_seed(seed)
    heads, rope, nope, rank, v_dim, theta = 3, 4, 6, 8, 5, 50.0
    geom = KVPoolGeometry(1, 10, 4, 1, rope + rank, 0, kv_kind=1)
    w_uk = torch.randn(heads, rank, nope, generator=gen) / rank**0.5  # kv_b_proj's key rows, per head
    w_uv = torch.randn(heads, rank, v_dim, generator=gen) / rank**0.5  # ... and its value rows
    counts, starts = torch.tensor([4, 1, 3], dtype=torch.int32), torch.tensor([0, 6, 2], dtype=torch.int32)
    tables = torch.tensor([[1, -1, -1], [2, 3, -1], [4, 5, -1]], dtype=torch.int32)
    kv_lens = starts + counts
    # Every position each request will attend to: its earlier context, then this step's rows.
    ctx = [torch.randn(int(n), rope + rank, generator=gen) for n in kv_lens]  # unroped k_pe ; c_kv
    pool = allocate_pool(geom)
    ptr, inv = pool_address(pool), _inv_freq(rope, theta)
    all_rows = torch.cat(ctx)
    whole = torch.zeros_like(counts)
    torch.ops.mtp.mla_kv_write(all_rows, kv_lens, whole, tables, ptr, inv, 0, *geom.attrs().values(), rope, rope_scale)
    scale = (nope + rope) ** -0.5
    q_pe = torch.randn(int(counts.sum()), heads, rope, generator=gen)  # roped by the model
    q_nope = torch.randn(int(counts.sum()), heads, nope, generator=gen)
    q_abs = torch.cat([q_pe, torch.einsum("thn,hrn->thr", q_nope, w_uk)], dim=-1)
    after = torch.zeros(1, dtype=torch.int64)
    o_lat = torch.ops.mtp.mla_paged_attention(q_abs, counts, kv_lens, tables, ptr, after, 0, *geom.attrs().values(),
                                              rope, scale)  # fmt: skip
    absorbed = torch.einsum("thr,hrv->thv", o_lat, w_uv)

    naive = torch.zeros_like(absorbed)
    row = 0
    for r, rows in enumerate(ctx):
        n_q, n_kv = int(counts[r]), rows.shape[0]
        k_pe = apply_rope(rows[:, None, :rope], torch.arange(n_kv), rope, theta)[:, 0] * rope_scale
        c_kv = rows[:, rope:]
        for h in range(heads):
            keys = torch.cat([k_pe, c_kv @ w_uk[h]], dim=-1)  # [n_kv, rope + nope]
            values = c_kv @ w_uv[h]
            queries = torch.cat([q_pe[row : row + n_q, h], q_nope[row : row + n_q, h]], dim=-1)
            scores = queries @ keys.T * scale
            q_pos = n_kv - n_q + torch.arange(n_q)
            scores = scores.masked_fill(torch.arange(n_kv)[None, :] > q_pos[:, None], float("-inf"))
            naive[row : row + n_q, h] = scores.softmax(-1) @ values
        row += n_q
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=0)


def test_mla_pool_geometry() -> None:
    geom = KVPoolGeometry(3, 5, 4, 1, 10, 2, kv_kind=1)
    assert geom.shape == (3, 1, 5, 4, 1, 10) and geom.nbytes == 3 * 5 * 4 * 10 * 2
    assert geom.attrs() == {"num_planes": 3, "num_blocks": 5, "block_size": 4, "latent_dim": 10, "dtype": 2}
    assert KVPoolGeometry(3, 5, 4, 2, 10).shape == (3, 2, 5, 4, 2, 10)  # GQA unchanged
    pool = allocate_pool(geom)
    lat, same = plane_kv(pool.data_ptr(), geom, 2)
    assert lat is same and lat.shape == (20, 1, 10)
    lat[7, 0, 3] = 1.5  # the view is the pool's memory: plane 2, block 1, slot 3
    assert float(pool[2, 0, 1, 3, 0, 3]) == 1.5
    layout = KVLayout(4, 5, 3, 1, 10, 2, 9, kv_kind=1)
    assert layout.geometry() == geom and layout.geometry(7).num_blocks == 7
    with pytest.raises(ValueError, match="num_kv_heads 1"):
        KVPoolGeometry(3, 5, 4, 2, 10, 0, kv_kind=1)
    with pytest.raises(ValueError, match="neither 0"):
        KVPoolGeometry(3, 5, 4, 1, 10, 0, kv_kind=2)


def test_mla_ops_reject_bad_inputs() -> None:
    geom = KVPoolGeometry(1, 4, 2, 1, 8, 0, kv_kind=1)
    pool = allocate_pool(geom)
    one, tables = torch.ones(1, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32)
    inv = torch.ones(2)
    with pytest.raises(ValueError, match=r"latent must be \[T, 8\]"):
        torch.ops.mtp.mla_kv_write(torch.zeros(2, 6), one, one, tables, pool_address(pool), inv, 0,
                                   *geom.attrs().values(), 4, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"inv_freq has shape \(2,\), rope_dim 6 needs \[3\]"):
        torch.ops.mtp.mla_kv_write(torch.zeros(2, 8), one, one, tables, pool_address(pool), inv, 0,
                                   *geom.attrs().values(), 6, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="kv_kind 1"):
        mla_triton.mla_kv_write_triton(torch.zeros(2, 8), one, one, tables, pool.data_ptr(), inv, 0,
                                       KVPoolGeometry(1, 4, 2, 1, 8, 0), 4, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"q: expected \[T, H, 8\]"):
        mla_triton.mla_paged_attention_triton(torch.zeros(1, 2, 6), one, one, tables, pool.data_ptr(), 0, geom, 4, 1.0)
    with pytest.raises(ValueError, match="int32/int64"):
        mla_triton.mla_paged_attention_triton(torch.zeros(1, 2, 8), one.float(), one, tables, pool.data_ptr(), 0,
                                              geom, 4, 1.0)  # fmt: skip


MLA_GEOM = KVPoolGeometry(2, 8, 4, 1, 12, 0, kv_kind=1)


class _TinyMla(torch.nn.Module):
    """One MLA layer's plugin calls: roped latent write (the commit pass form), then absorbed attention."""

    def forward(self, latent, counts, starts, tables, pool_ptr, inv_freq, q, kv_lens):
        g = MLA_GEOM.attrs().values()
        n = torch.ops.mtp.mla_kv_write(latent, counts, starts, tables, pool_ptr, inv_freq, 1, *g, 4, 1.25)
        att = torch.ops.mtp.mla_paged_attention(q, counts, kv_lens, tables, pool_ptr, n, 1, *g, 4, 0.3)
        return att * 2.0, n


def test_mla_export_emits_plugin_nodes_and_runs_in_ort() -> None:
    from plugins.onnx_export import custom_translation_table
    from plugins.ort_ops import make_session

    gen = torch.Generator().manual_seed(5)
    i32 = torch.int32
    counts, starts = torch.tensor([3, 0, 5], dtype=i32), torch.tensor([2, 0, 3], dtype=i32)
    tables = torch.tensor([[1, 2, -1], [3, -1, -1], [4, 5, -1]], dtype=i32)
    args = (torch.randn(9, 12, generator=gen), counts, starts, tables, pool_address(allocate_pool(MLA_GEOM)),
            _inv_freq(4, 30.0), torch.randn(9, 3, 12, generator=gen), starts + counts)  # fmt: skip
    exported = torch.onnx.export(_TinyMla().eval(), args, dynamo=True,
                                 custom_translation_table=custom_translation_table())  # fmt: skip
    assert exported is not None
    model = exported.model_proto
    onnx.checker.check_model(model, full_check=True)
    nodes = {n.op_type: n for n in model.graph.node if n.domain == "mtp"}
    assert set(nodes) == {"MlaKvWrite", "MlaPagedAttention"}
    attrs = {op: {a.name: helper.get_attribute_value(a) for a in n.attribute} for op, n in nodes.items()}
    routing = {"plugin_namespace": b"mtp", "plugin_version": b"1"}
    assert attrs["MlaKvWrite"] == {"plane": 1, **MLA_GEOM.attrs(), "rope_dim": 4, "rope_scale": pytest.approx(1.25),
                                   **routing}  # fmt: skip
    assert attrs["MlaPagedAttention"] == {"plane": 1, **MLA_GEOM.attrs(), "rope_dim": 4, "scale": pytest.approx(0.3),
                                          **routing}  # fmt: skip
    assert nodes["MlaKvWrite"].output[0] in nodes["MlaPagedAttention"].input  # the read is ordered after the write

    eager_pool, ort_pool = allocate_pool(MLA_GEOM), allocate_pool(MLA_GEOM)
    eager = _TinyMla()(*args[:4], pool_address(eager_pool), *args[5:])
    session = make_session(model)
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
    feeds[session.get_inputs()[4].name] = pool_address(ort_pool).numpy()
    got = session.run(None, feeds)
    for g, e in zip(got, eager, strict=True):
        np.testing.assert_allclose(g, e.numpy(), atol=1e-5)
    assert torch.equal(ort_pool, eager_pool) and int(got[1][0]) == 8
    # ... and both equal the reference: the ORT op writes the pool in place through its address.
    ref_pool = allocate_pool(MLA_GEOM)
    mla_kv_write_ref(ref_pool, args[0], counts, starts, tables, 1, args[5], 4, 1.25)
    torch.testing.assert_close(ort_pool, ref_pool, atol=1e-6, rtol=0)
    ref = mla_paged_attention_ref(ref_pool, args[6], counts, starts + counts, tables, 1, 4, 0.3) * 2.0
    np.testing.assert_allclose(got[0], ref.numpy(), atol=1e-5)
