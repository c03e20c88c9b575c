"""One spec per plugin op (plugins/op_spec.py): every backend's view is derived from it (plugins/op_backends.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plugins.collectives  # noqa: F401
import plugins.gdn_ops  # noqa: F401
import plugins.mla_ops  # noqa: F401
import plugins.ops  # noqa: F401
from plugins.op_backends import onnx_schema, translation
from plugins.op_spec import FLOAT, INDEX, INT64, SPECS, Attr, OpSpec, Tensor, accepts

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the dummy op must not stay registered in the test process.
NEW_OP = '''
import numpy as np
import torch

from plugins.op_backends import install
from plugins.onnx_export import custom_translation_table
from plugins.op_spec import FLOAT, INDEX, Attr, OpSpec, Tensor, register

spec = register(OpSpec(
    "test_scale_rows", "TestScaleRows", "y[t] = x[t] * factor * counts-free scale; a dummy op for this test",
    (Tensor("x", FLOAT, "[T, H]"), Tensor("rows", INDEX, "[R]")), (Attr("factor", float, "scale"),
    Attr("offset", int, "added")), (Tensor("y", FLOAT, "[T, H]"),), lambda x, rows, **attrs: torch.empty_like(x),
))
install(spec, cpu=lambda x, rows, factor, offset: x * factor + offset + rows.sum().to(x.dtype))

x, rows = torch.randn(3, 4), torch.tensor([1, 2], dtype=torch.int32)
want = x * 2.5 + 3 + 3
assert torch.equal(torch.ops.mtp.test_scale_rows(x, rows, 2.5, 3), want), "torch"

class Tiny(torch.nn.Module):
    def forward(self, x, rows):
        return torch.ops.mtp.test_scale_rows(x, rows, 2.5, 3) - 1.0

exported = torch.onnx.export(Tiny(), (x, rows), dynamo=True, custom_translation_table=custom_translation_table())
nodes = [n for n in exported.model_proto.graph.node if n.domain == "mtp"]
assert [n.op_type for n in nodes] == ["TestScaleRows"], "onnx export"
attrs = {a.name: a for a in nodes[0].attribute}
assert attrs["factor"].f == 2.5 and attrs["offset"].i == 3 and attrs["plugin_namespace"].s == b"mtp", "attributes"

from plugins.ort_ops import make_session

names = [i.name for i in exported.model_proto.graph.input]
got = make_session(exported.model_proto).run(None, dict(zip(names, (x.numpy(), rows.numpy()))))[0]
np.testing.assert_allclose(got, (want - 1.0).numpy(), rtol=1e-6)
print("registered in torch, ONNX export and ONNX Runtime")
'''


def test_a_new_spec_is_an_op_of_torch_onnx_export_and_ort():
    """A dummy op written only as a spec (plus its CPU kernel) runs in torch, exports to an `mtp` node with its
    attributes, and runs in ONNX Runtime; no project file is touched."""
    out = subprocess.run([sys.executable, "-c", NEW_OP], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "registered in torch, ONNX export and ONNX Runtime" in out.stdout


@pytest.mark.parametrize("op", sorted(SPECS))
def test_torch_schema_and_fake_follow_the_spec(op):
    spec = SPECS[op]
    assert str(getattr(torch.ops.mtp, op).default._schema).replace("SymInt", "int") == f"mtp::{spec.torch_schema}"
    schema = onnx_schema(spec)
    assert [i.name for i in schema.inputs] == [t.name for t in spec.inputs]
    assert sorted(schema.attributes) == sorted([a.name for a in spec.attrs] + ["plugin_namespace", "plugin_version"])
    params = list(translation(spec).__signature__.parameters.values())  # type: ignore[attr-defined]
    assert [p.name for p in params] == [t.name for t in spec.inputs] + [a.name for a in spec.attrs]
    assert [p.annotation for p in params[len(spec.inputs) :]] == [a.kind for a in spec.attrs]


def test_tensorrt_format_checks_follow_the_dtype_classes():
    spec = OpSpec("x", "X", "", (Tensor("a", FLOAT, ""), Tensor("b", FLOAT, ""), Tensor("i", INDEX, ""),
                                  Tensor("p", INT64, ""), Tensor("w", FLOAT, "", type_var="W")),
                  (Attr("n", int, ""),), (Tensor("y", FLOAT, ""),), lambda *a, **k: a[0])  # fmt: skip
    ok = ["bfloat16", "bfloat16", "int32", "int64", "float32", "bfloat16"]
    assert all(accepts(spec, pos, ok) for pos in range(len(ok)))
    assert not accepts(spec, 1, ["bfloat16", "float32"])  # b must be a's type
    assert not accepts(spec, 2, ["float32", "float32", "float32"])  # an index
    assert not accepts(spec, 3, ["float32", "float32", "int32", "int32"])  # an address is int64
    assert not accepts(spec, 5, ["float16", "float16", "int32", "int64", "float32", "float32"])  # output: a's type
    assert not accepts(spec, 0, ["int8"])


def test_in_place_inputs_are_addresses_the_spec_names():
    """Mutated inputs are in the contract as int64[1] addresses written through (`writes`), never as tensors: ONNX
    Runtime's Python ops receive copies of tensor inputs, so a write to a pool tensor would be lost."""
    assert SPECS["kv_write"].written == ("pool_ptr",) and SPECS["mla_kv_write"].written == ("pool_ptr",)
    assert SPECS["gdn_step"].written == ("conv_pool_ptr", "ssm_pool_ptr")
    assert SPECS["paged_attention"].written == () and SPECS["moe_experts"].written == ()
    with pytest.raises(ValueError, match="an input written in place is an int64"):
        Tensor("conv_pool", FLOAT, "[S, C, K-1]", writes=True)
    with pytest.raises(ValueError, match="an input written in place is an int64"):
        Tensor("state", INT64, "[1]", writes=True)


def test_a_kernel_library_with_another_schema_is_refused():
    from plugins.op_backends import define_torch

    spec = SPECS["kv_write"]
    wrong = OpSpec(spec.op, spec.node, spec.doc, spec.inputs[:-1], spec.attrs, spec.outputs, spec.shape)
    with pytest.raises(RuntimeError, match="plugins/op_spec.py is the one source"):
        define_torch(wrong)
