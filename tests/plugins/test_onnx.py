"""Plugin nodes in ONNX: schemas, the dynamo export rules, and the ONNX Runtime custom ops.

* a graph built with onnx.helper holding KvWrite -> PagedAttention (domain mtp) runs in a real
  InferenceSession and matches the reference (pool written in place through its address);
* a tiny nn.Module calling the ops exports (dynamo=True + custom_translation_table) to nodes in domain mtp
  with every attribute, passes the full checker, and runs in ORT matching eager.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from onnx import TensorProto, helper

import plugins.ops  # noqa: F401
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from plugins.onnx_export import DOMAIN, PLUGIN_VERSION, custom_translation_table, register_schemas
from plugins.ort_ops import ORT_DOMAIN, make_session, prepare_for_ort
from plugins.reference import kv_write_ref, moe_experts_ref, paged_attention_ref
from tests.plugins.cases import Case, cases, filled_pool

register_schemas()


def _plugin_graph(c: Case, scale: float) -> onnx.ModelProto:
    geometry = c.geom.attrs()
    common: dict[str, Any] = {"plane": c.plane, **geometry, "plugin_namespace": DOMAIN, "plugin_version": PLUGIN_VERSION}
    i32, f32, i64 = TensorProto.INT32, TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("k", f32, ["T", c.geom.num_kv_heads, c.geom.head_dim]),
        helper.make_tensor_value_info("v", f32, ["T", c.geom.num_kv_heads, c.geom.head_dim]),
        helper.make_tensor_value_info("counts", i32, ["R"]),
        helper.make_tensor_value_info("starts", i32, ["R"]),
        helper.make_tensor_value_info("block_tables", i32, ["R", "M"]),
        helper.make_tensor_value_info("pool_ptr", i64, [1]),
        helper.make_tensor_value_info("q", f32, ["T", c.q.shape[1], c.geom.head_dim]),
        helper.make_tensor_value_info("kv_lens", i32, ["R"]),
    ]
    nodes = [
        helper.make_node("KvWrite", ["k", "v", "counts", "starts", "block_tables", "pool_ptr"], ["written"],
                         domain=DOMAIN, rope_dim=c.rope_dim, rope_theta=10000.0, **common),
        helper.make_node("PagedAttention", ["q", "counts", "kv_lens", "block_tables", "pool_ptr", "written"],
                         ["out"], domain=DOMAIN, scale=scale, **common),
    ]  # fmt: skip
    outputs = [
        helper.make_tensor_value_info("out", f32, ["T", c.q.shape[1], c.geom.head_dim]),
        helper.make_tensor_value_info("written", i64, [1]),
    ]
    graph = helper.make_graph(nodes, "plugins", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases(dtypes=(torch.float32,), holes=False))
def test_ort_custom_ops_match_reference(c: Case) -> None:
    scale = 0.37
    model = _plugin_graph(c, scale)
    onnx.checker.check_model(model, full_check=True)
    pool = filled_pool(c.geom)
    expected_pool = pool.clone()
    n_ref = kv_write_ref(expected_pool, c.k, c.v, c.counts, c.starts, c.tables, c.plane, c.rope_dim, 10000.0)
    expected = paged_attention_ref(expected_pool, c.q, c.counts, c.kv_lens, c.tables, c.plane, scale)
    feeds = {"k": c.k, "v": c.v, "counts": c.counts, "starts": c.starts, "block_tables": c.tables,
             "pool_ptr": pool_address(pool), "q": c.q, "kv_lens": c.kv_lens}  # fmt: skip
    out, written = make_session(model).run(None, {name: t.numpy() for name, t in feeds.items()})
    assert int(written[0]) == n_ref
    torch.testing.assert_close(pool, expected_pool, atol=1e-5, rtol=0)  # written in place via the address
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-4)


@settings(max_examples=3, deadline=None)
@given(c=cases(dtypes=(torch.float32,)))
def test_prepare_for_ort_rewrites_in_memory_only(c: Case) -> None:
    model = _plugin_graph(c, 1.0)
    prepared = prepare_for_ort(model)
    assert {n.domain for n in prepared.graph.node} == {ORT_DOMAIN}
    assert {n.domain for n in model.graph.node} == {DOMAIN}, "the original (on-disk form) must keep domain mtp"
    assert ORT_DOMAIN in {o.domain for o in prepared.opset_import}


GEOM = KVPoolGeometry(2, 8, 4, 2, 8, 0)


class _Tiny(torch.nn.Module):
    def forward(self, k, v, counts, starts, tables, pool_ptr, q, kv_lens, x, ids, weights, w_gate_up, w_down):
        g = GEOM.attrs().values()
        n = torch.ops.mtp.kv_write(k, v, counts, starts, tables, pool_ptr, 1, *g, 4, 10000.0)
        att = torch.ops.mtp.paged_attention(q, counts, kv_lens, tables, pool_ptr, n, 1, *g, 0.35)
        moe = torch.ops.mtp.moe_experts(x, ids, weights, w_gate_up, w_down, 4, 1)
        return att * 2.0, n, moe + 1.0


def _tiny_args(pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    i32 = torch.int32
    return (torch.randn(9, 2, 8, generator=gen), torch.randn(9, 2, 8, generator=gen), torch.tensor([3, 0, 5], dtype=i32),
            torch.tensor([2, 0, 3], dtype=i32), torch.tensor([[1, 2, -1], [3, -1, -1], [4, 5, -1]], dtype=i32),
            pool_address(pool), torch.randn(8, 4, 8, generator=gen), torch.tensor([5, 0, 8], dtype=i32),
            torch.randn(5, 6, generator=gen), torch.tensor([[0, 3], [1, 2], [2, 2], [3, 0], [1, 1]]),
            torch.rand(5, 2, generator=gen), torch.randn(4, 10, 6, generator=gen), torch.randn(4, 6, 5, generator=gen))  # fmt: skip


def test_export_emits_plugin_nodes_and_runs_in_ort() -> None:
    pool = allocate_pool(GEOM)
    args = _tiny_args(pool)
    exported = torch.onnx.export(_Tiny().eval(), args, dynamo=True, custom_translation_table=custom_translation_table())
    assert exported is not None
    model = exported.model_proto
    onnx.checker.check_model(model, full_check=True)
    plugin_nodes = {n.op_type: n for n in model.graph.node if n.domain == DOMAIN}
    assert set(plugin_nodes) == {"KvWrite", "PagedAttention", "MoeExperts"}
    attrs = {op: {a.name: helper.get_attribute_value(a) for a in n.attribute} for op, n in plugin_nodes.items()}
    assert attrs["KvWrite"] == {"plane": 1, **GEOM.attrs(), "rope_dim": 4, "rope_theta": pytest.approx(10000.0),
                                "plugin_namespace": b"mtp", "plugin_version": b"1"}  # fmt: skip
    assert attrs["PagedAttention"]["scale"] == pytest.approx(0.35)
    assert attrs["MoeExperts"] == {"num_experts": 4, "ep_size": 1, "tp_size": 1, "tp_rank": 0, "plugin_namespace": b"mtp",
                                   "plugin_version": b"1"}  # fmt: skip
    assert (DOMAIN, 1) in {(o.domain, o.version) for o in model.opset_import}
    # The written count feeds attention, so the write cannot be pruned or reordered after its reader.
    assert plugin_nodes["KvWrite"].output[0] in plugin_nodes["PagedAttention"].input

    eager_pool = allocate_pool(GEOM)
    eager = _Tiny()(*args[:5], pool_address(eager_pool), *args[6:])
    ort_pool = allocate_pool(GEOM)
    session = make_session(model)
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
    feeds[session.get_inputs()[5].name] = pool_address(ort_pool).numpy()
    got = session.run(None, feeds)
    for g, e in zip(got, eager, strict=True):
        np.testing.assert_allclose(g, e.numpy(), atol=1e-4)
    torch.testing.assert_close(ort_pool, eager_pool)
    x, ids, weights, w_gate_up, w_down = args[8:]
    moe_ref = moe_experts_ref(x, ids, weights, w_gate_up, w_down) + 1.0
    np.testing.assert_allclose(got[2], moe_ref.numpy(), atol=1e-4)
