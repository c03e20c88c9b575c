"""The GdnStep node (`mtp::gdn_step` in ONNX): a one-node graph runs in a real ONNX Runtime session and equals
plugins/reference.py `gdn_step_ref`, writing the state pool in place through its addresses; padded requests and
unstored rows write nothing, other layers are never touched; a module calling the op exports to one GdnStep node
with every geometry attribute."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

import plugins.gdn_ops  # noqa: F401  (torch.ops.mtp.gdn_step)
from plugins.gdn_pool import GDNPoolGeometry, address, allocate_state
from plugins.names import GDN_STEP
from plugins.onnx_export import DOMAIN, PLUGIN_VERSION, custom_translation_table, register_schemas
from plugins.op_spec import SPECS
from plugins.ort_ops import make_session
from plugins.reference import gdn_step_ref

register_schemas()
GEOM = GDNPoolGeometry(num_layers=2, num_slots=6, conv_dim=2 * 2 * 8 + 4 * 6, conv_kernel=4, num_k_heads=2,
                       num_v_heads=4, head_k_dim=8, head_v_dim=6)  # fmt: skip
LAYER = 1
I32 = torch.int32


def _graph() -> onnx.ModelProto:
    spec = SPECS["gdn_step"]
    f32, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
    types = {"float": f32, "index": i32, "int64": i64, "fp32": f32}
    x = _inputs()
    shapes = {t.name: list(x[t.name].shape) if t.name in x else [1] for t in spec.inputs}
    inputs = [helper.make_tensor_value_info(t.name, types[t.dtype], shapes[t.name]) for t in spec.inputs]
    node = helper.make_node(GDN_STEP, [t.name for t in spec.inputs], ["out"], domain=DOMAIN, **GEOM.attrs(LAYER),
                            plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)  # fmt: skip
    out = helper.make_tensor_value_info("out", f32, ["T", GEOM.num_v_heads, GEOM.head_v_dim])
    graph = helper.make_graph([node], "gdn", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)])


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t, c, hv = 8, GEOM.conv_dim, GEOM.num_v_heads
    return dict(
        mixed=torch.randn(t, c, generator=g), b=torch.randn(t, hv, generator=g), a=torch.randn(t, hv, generator=g),
        # a 4-row fresh prefill (last row stored), a padded request, a 3-row verify from slot 2 (every row stored),
        # a padded request, a 1-row decode from slot 3 (not stored)
        q_counts=torch.tensor([4, 0, 3, 0, 1], dtype=I32), starts=torch.tensor([0, 5, 9, 0, 4], dtype=I32),
        read_slots=torch.tensor([5, 0, 2, 1, 3], dtype=I32),
        write_slots=torch.tensor([-1, -1, -1, 0, 1, 4, 5, -1], dtype=I32),
        conv_weight=0.3 * torch.randn(c, GEOM.conv_kernel, generator=g), a_log=0.5 * torch.randn(hv, generator=g),
        dt_bias=0.5 * torch.randn(hv, generator=g),
    )  # fmt: skip


def test_ort_node_equals_reference_and_writes_only_its_slots():
    x = _inputs()
    conv, ssm = allocate_state(GEOM)
    conv.fill_(float("nan"))
    ssm.fill_(float("nan"))
    g = torch.Generator().manual_seed(7)
    for s in (2, 3):  # the slots read by continuing requests hold real states; every other slot is NaN
        conv[LAYER, s], ssm[LAYER, s] = torch.randn(GEOM.conv_dim, 3, generator=g), 0.1 * torch.randn(4, 8, 6, generator=g)
    want_conv, want_ssm = conv[LAYER].clone(), ssm[LAYER].clone()
    want = gdn_step_ref(x["mixed"], x["b"], x["a"], x["q_counts"], x["starts"], x["read_slots"], x["write_slots"],
                        want_conv, want_ssm, x["conv_weight"], x["a_log"], x["dt_bias"], GEOM.num_k_heads,
                        GEOM.head_k_dim, GEOM.head_v_dim)  # fmt: skip
    feeds = {k: v.numpy() for k, v in x.items()} | {"conv_pool_ptr": address(conv).numpy(),
                                                   "ssm_pool_ptr": address(ssm).numpy()}  # fmt: skip
    model = _graph()
    onnx.checker.check_model(model, full_check=True)
    (out,) = make_session(model).run(None, feeds)
    np.testing.assert_allclose(out, want.numpy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv[LAYER], want_conv, equal_nan=True)  # written in place through the address
    torch.testing.assert_close(ssm[LAYER], want_ssm, equal_nan=True)
    assert conv[0].isnan().all() and ssm[0].isnan().all(), "another layer of the pool was written"
    stored = {0, 1, 4, 5}
    for s in range(GEOM.num_slots):  # padded requests and rows with write slot -1 store nothing
        assert bool(ssm[LAYER, s].isfinite().all()) == (s in stored or s in (2, 3)), f"slot {s}"
    assert not np.isnan(out).any()


class _OneLayer(torch.nn.Module):
    def forward(self, mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool_ptr, ssm_pool_ptr):
        w, a_log, dt = torch.ones(GEOM.conv_dim, GEOM.conv_kernel), torch.zeros(4), torch.ones(4)
        return torch.ops.mtp.gdn_step(mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool_ptr,
                                      ssm_pool_ptr, w, a_log, dt, **GEOM.attrs(LAYER)) * 2.0  # fmt: skip


def test_a_module_exports_to_one_gdn_node_that_runs_in_ort():
    x = _inputs(1)
    conv, ssm = allocate_state(GEOM)
    args = (x["mixed"], x["b"], x["a"], x["q_counts"], x["starts"], x["read_slots"], x["write_slots"],
            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))  # fmt: skip
    exported = torch.onnx.export(_OneLayer().eval(), args, dynamo=True, custom_translation_table=custom_translation_table())
    nodes = [n for n in exported.model_proto.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [GDN_STEP]
    assert {a.name: a.i for a in nodes[0].attribute if a.type == onnx.AttributeProto.INT} == GEOM.attrs(LAYER)
    feeds = [t.numpy() for t in args[:7]] + [address(conv).numpy(), address(ssm).numpy()]
    names = [i.name for i in exported.model_proto.graph.input]
    (got,) = make_session(exported.model_proto).run(None, dict(zip(names, feeds, strict=True)))
    conv2, ssm2 = allocate_state(GEOM)
    want = _OneLayer()(*args[:7], address(conv2), address(ssm2))
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm, ssm2)  # both wrote the same states through their addresses
    assert ssm[LAYER, 5].abs().sum() > 0 and ssm[0].abs().sum() == 0
