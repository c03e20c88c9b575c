"""ONNX Runtime execution of the plugin nodes through onnxruntime-extensions Python custom ops.

Owns: the `@onnx_op` definitions of `KvWrite`, `PagedAttention`, `MoeExperts`, `MlaKvWrite`,
`MlaPagedAttention` (domain `ai.onnx.contrib`,
the only domain onnxruntime-extensions' Python ops live in), `prepare_for_ort` (in-memory domain rewrite
`mtp` -> `ai.onnx.contrib`; files on disk keep `mtp`, which TensorRT needs) and `make_session_options`.

The ops only convert arguments and call the torch ops of plugins/ops.py (CPU path), so there is one
implementation of the math. The pool arrives as an address: Python custom ops get *copies* of their
tensor inputs, so writes through a pool tensor input would be lost.

Limits of onnxruntime-extensions Python ops: one fixed element type per input, so these ops take fp32
rows/activations and int32 per-request metadata and block tables (the model's types), int64 topk ids.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime_extensions import PyOp, get_library_path, onnx_op

import plugins.mla_ops  # noqa: F401  (defines torch.ops.mtp.mla_*)
import plugins.ops  # noqa: F401  (defines torch.ops.mtp.*)
from plugins.names import COLLECTIVE_NODES, PLUGIN_NODES
from plugins.onnx_export import (
    COLLECTIVE_ATTRS,
    DOMAIN,
    KV_WRITE_ATTRS,
    MLA_KV_WRITE_ATTRS,
    MLA_PAGED_ATTENTION_ATTRS,
    MOE_EXPERTS_ATTRS,
    PAGED_ATTENTION_ATTRS,
)

ORT_DOMAIN = "ai.onnx.contrib"
PLUGIN_OPS = (*PLUGIN_NODES, *COLLECTIVE_NODES)

_ATTR_TYPES = {onnx.defs.OpSchema.AttrType.INT: PyOp.dt_int64, onnx.defs.OpSchema.AttrType.FLOAT: PyOp.dt_float}


def _attrs(spec: list[tuple[str, onnx.defs.OpSchema.AttrType, str]]) -> dict[str, int]:
    # The TensorRT routing strings are declared too so that nodes carrying them are accepted.
    types = {name: _ATTR_TYPES[t] for name, t, _ in spec}
    return types | {"plugin_namespace": PyOp.dt_string, "plugin_version": PyOp.dt_string}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


_I32, _I64, _F32 = PyOp.dt_int32, PyOp.dt_int64, PyOp.dt_float


@onnx_op(
    op_type="KvWrite",
    inputs=[_F32, _F32, _I32, _I32, _I32, _I64],
    outputs=[_I64],
    attrs=_attrs(KV_WRITE_ATTRS),
)
def kv_write_op(k, v, counts, starts, block_tables, pool_ptr, **attrs):
    geometry = {name: int(attrs[name]) for name, _, _ in KV_WRITE_ATTRS[:-1]}
    out = torch.ops.mtp.kv_write(
        _t(k), _t(v), _t(counts), _t(starts), _t(block_tables), _t(pool_ptr), **geometry,
        rope_theta=float(attrs["rope_theta"]),
    )  # fmt: skip
    return out.numpy()


@onnx_op(
    op_type="PagedAttention",
    inputs=[_F32, _I32, _I32, _I32, _I64, _I64],
    outputs=[_F32],
    attrs=_attrs(PAGED_ATTENTION_ATTRS),
)
def paged_attention_op(q, q_counts, kv_lens, block_tables, pool_ptr, after, **attrs):
    geometry = {name: int(attrs[name]) for name, _, _ in PAGED_ATTENTION_ATTRS[:-1]}
    out = torch.ops.mtp.paged_attention(
        _t(q), _t(q_counts), _t(kv_lens), _t(block_tables), _t(pool_ptr), _t(after), **geometry,
        scale=float(attrs["scale"]),
    )  # fmt: skip
    return out.numpy()


@onnx_op(
    op_type="MoeExperts",
    inputs=[_F32, _I64, _F32, _F32, _F32],
    outputs=[_F32],
    attrs=_attrs(MOE_EXPERTS_ATTRS),
)
def moe_experts_op(x, topk_ids, topk_weights, w_gate_up, w_down, **attrs):
    out = torch.ops.mtp.moe_experts(
        _t(x), _t(topk_ids), _t(topk_weights), _t(w_gate_up), _t(w_down),
        int(attrs["num_experts"]), int(attrs["ep_size"]), int(attrs["tp_size"]), int(attrs["tp_rank"]),
    )  # fmt: skip
    return out.numpy()


# MLA latent KV (plugins/mla_ops.py): the ints are the geometry and rope_dim, the last attribute the float.
@onnx_op(
    op_type="MlaKvWrite",
    inputs=[_F32, _I32, _I32, _I32, _I64, _F32],
    outputs=[_I64],
    attrs=_attrs(MLA_KV_WRITE_ATTRS),
)
def mla_kv_write_op(latent, counts, starts, block_tables, pool_ptr, inv_freq, **attrs):
    ints = {name: int(attrs[name]) for name, _, _ in MLA_KV_WRITE_ATTRS[:-1]}
    out = torch.ops.mtp.mla_kv_write(
        _t(latent), _t(counts), _t(starts), _t(block_tables), _t(pool_ptr), _t(inv_freq), **ints,
        rope_scale=float(attrs["rope_scale"]),
    )  # fmt: skip
    return out.numpy()


@onnx_op(
    op_type="MlaPagedAttention",
    inputs=[_F32, _I32, _I32, _I32, _I64, _I64],
    outputs=[_F32],
    attrs=_attrs(MLA_PAGED_ATTENTION_ATTRS),
)
def mla_paged_attention_op(q, q_counts, kv_lens, block_tables, pool_ptr, after, **attrs):
    ints = {name: int(attrs[name]) for name, _, _ in MLA_PAGED_ATTENTION_ATTRS[:-1]}
    out = torch.ops.mtp.mla_paged_attention(
        _t(q), _t(q_counts), _t(kv_lens), _t(block_tables), _t(pool_ptr), _t(after), **ints,
        scale=float(attrs["scale"]),
    )  # fmt: skip
    return out.numpy()


# --- Tensor-parallel collectives: mpi4py over the TP comm (plugins/collectives.py), fp32 like every op here.
@onnx_op(op_type="AllReduce", inputs=[_F32], outputs=[_F32], attrs=_attrs(COLLECTIVE_ATTRS))
def all_reduce_op(x, **attrs):
    from plugins.collectives import all_reduce_numpy

    return all_reduce_numpy(x, int(attrs["tp_size"]))


@onnx_op(op_type="AllGather", inputs=[_F32], outputs=[_F32], attrs=_attrs(COLLECTIVE_ATTRS))
def all_gather_op(x, **attrs):
    from plugins.collectives import all_gather_numpy

    return all_gather_numpy(x, int(attrs["tp_size"]))


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
            if node.domain == DOMAIN and node.op_type in PLUGIN_OPS:
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
