"""ONNX Runtime execution of the plugin nodes through onnxruntime-extensions Python custom ops.

Owns `prepare_for_ort` (in-memory domain rewrite `mtp` -> `ai.onnx.contrib`, the only domain onnxruntime-extensions'
Python ops live in; files on disk keep `mtp`, which TensorRT needs), `make_session_options` and `make_session`. The
ops themselves are derived from the op specs (plugins/op_backends.py): each converts its arguments and calls the
torch op (CPU kernel), so there is one implementation of the math. The pool arrives as an address: Python custom ops get *copies* of their
tensor inputs, so writes through a pool tensor input would be lost.

Limits of onnxruntime-extensions Python ops: one fixed element type per input, so these ops take fp32
rows/activations and int32 per-request metadata and block tables (the model's types), int64 topk ids.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
from onnxruntime_extensions import get_library_path

import plugins.collectives  # noqa: F401  (kernels of torch.ops.mtp.all_*)
import plugins.gdn_ops  # noqa: F401  (kernel of torch.ops.mtp.gdn_step)
import plugins.mla_ops  # noqa: F401  (kernels of torch.ops.mtp.mla_*)
import plugins.ops  # noqa: F401  (kernels of torch.ops.mtp.*)
from plugins.names import DOMAIN
from plugins.op_backends import ORT_DOMAIN, install_all
from plugins.op_spec import SPECS

install_all()  # one onnxruntime-extensions op per spec (plugins/op_backends.py)


def prepare_for_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose plugin nodes (domain `mtp`, any graph or function) are in `ai.onnx.contrib`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graphs: list[onnx.GraphProto] = [out.graph]
    node_lists = [f.node for f in out.functions]
    while graphs:
        g = graphs.pop()
        node_lists.append(g.node)
        for node in g.node:
            graphs.extend(onnx.helper.get_attribute_value(a) for a in node.attribute if a.type == a.GRAPH)
    for nodes in node_lists:
        for node in nodes:
            if node.domain == DOMAIN and node.op_type in {spec.node for spec in SPECS.values()}:
                node.domain = ORT_DOMAIN
    for proto in [out, *out.functions]:
        imports = {o.domain: o for o in proto.opset_import}
        if ORT_DOMAIN not in imports:
            proto.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))
    return out


def make_session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return options


def make_session(model: onnx.ModelProto, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """An InferenceSession (CPU) over `model` with the plugin nodes bound to the Python custom ops."""
    prepared = prepare_for_ort(model)
    return ort.InferenceSession(
        prepared.SerializeToString(), options or make_session_options(), providers=["CPUExecutionProvider"]
    )
