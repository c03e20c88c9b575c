"""ONNX export rules for the plugin ops: node schemas in the plugin domain and the dynamo translation table.

Owns the mapping `torch.ops.mtp.*` -> ONNX nodes `KvWrite` / `PagedAttention` / `MoeExperts` / `MlaKvWrite` /
`MlaPagedAttention` in domain `mtp` (= the TensorRT plugin namespace), version 1. The node contract is docs/ENGINE_FORMAT.md
"Plugin nodes". The export recipe, in short:

* schemas are registered before export (onnxscript refuses nodes of an unknown domain otherwise);
* translations are plain functions, not `@onnxscript.script` (a scripted function named like the op it
  emits becomes a self-calling function and export fails with a cyclic dependency).

Every node also carries `plugin_namespace="mtp"` and `plugin_version="1"`: from TensorRT 10.15 the parser
only prefers a registered plugin over other resolutions when `plugin_namespace` is present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import torch
from onnx.defs import OpSchema

import plugins.names as _names  # the TP collective nodes (own block below)
from plugins.names import (
    DOMAIN,
    KV_WRITE,
    MLA_KV_WRITE,
    MLA_PAGED_ATTENTION,
    MOE_EXPERTS,
    PAGED_ATTENTION,
    PLUGIN_VERSION,
)
from plugins.names import OPSET_VERSION as VERSION

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_INTS = ["tensor(int32)", "tensor(int64)"]
_ADDRESS = "tensor(int64)"

_INT = OpSchema.AttrType.INT
_FLOAT = OpSchema.AttrType.FLOAT
_STRING = OpSchema.AttrType.STRING

# Attribute names and types of each node, in the order of the torch op's non-tensor arguments.
_GEOMETRY: list[tuple[str, OpSchema.AttrType, str]] = [
    ("plane", _INT, "pool plane this node reads/writes"),
    ("num_planes", _INT, "pool geometry: planes"),
    ("num_blocks", _INT, "pool geometry: blocks per plane (block 0 is the null block)"),
    ("block_size", _INT, "pool geometry: positions per block"),
    ("num_kv_heads", _INT, "pool geometry: KV heads"),
    ("head_dim", _INT, "pool geometry: head dimension"),
    ("dtype", _INT, "pool element type: 0 fp32, 1 fp16, 2 bf16"),
]
KV_WRITE_ATTRS = [*_GEOMETRY, ("rope_dim", _INT, "rope K's first rope_dim dims at the write position; 0 = off"),
                  ("rope_theta", _FLOAT, "rope base")]  # fmt: skip
PAGED_ATTENTION_ATTRS = [*_GEOMETRY, ("scale", _FLOAT, "softmax scale applied to q.k")]
MOE_EXPERTS_ATTRS: list[tuple[str, OpSchema.AttrType, str]] = [
    ("num_experts", _INT, "global number of routed experts"),
    ("ep_size", _INT, "expert-parallel group size; this rank holds num_experts/ep_size experts"),
    ("tp_size", _INT, "tensor-parallel group size; > 1: the output is this rank's partial sum (see ARCHITECTURE §8)"),
    ("tp_rank", _INT, "this rank's place in its TP group = its expert column"),
]
# MLA nodes (plugins/mla_ops.py): an MLA pool has one latent "head", so no num_kv_heads and head_dim is latent_dim.
_MLA_GEOMETRY: list[tuple[str, OpSchema.AttrType, str]] = [
    ("plane", _INT, "pool plane this node reads/writes"),
    ("num_planes", _INT, "pool geometry: planes"),
    ("num_blocks", _INT, "pool geometry: blocks per plane (block 0 is the null block)"),
    ("block_size", _INT, "pool geometry: positions per block"),
    ("latent_dim", _INT, "pool geometry: latent row = qk_rope_head_dim + kv_lora_rank values"),
    ("dtype", _INT, "pool element type: 0 fp32, 1 fp16, 2 bf16"),
]
MLA_KV_WRITE_ATTRS = [*_MLA_GEOMETRY,
                      ("rope_dim", _INT, "rope the latent's first rope_dim dims at the write position; 0 = off"),
                      ("rope_scale", _FLOAT, "YaRN attention factor multiplying cos and sin (1.0 = none)")]  # fmt: skip
MLA_PAGED_ATTENTION_ATTRS = [*_MLA_GEOMETRY, ("rope_dim", _INT, "values are latent[:, rope_dim:] (c_kv)"),
                             ("scale", _FLOAT, "softmax scale applied to q.latent")]  # fmt: skip
_PLUGIN_ATTRS = [
    ("plugin_namespace", _STRING, "TensorRT plugin namespace (always 'mtp')"),
    ("plugin_version", _STRING, "TensorRT plugin version (always '1')"),
]


def _param(name: str, type_str: str, doc: str) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(name, type_str, doc)


def _schema(
    name: str,
    doc: str,
    inputs: list[tuple[str, str, str]],
    outputs: list[tuple[str, str, str]],
    attrs: list[tuple[str, OpSchema.AttrType, str]],
    type_constraints: list[tuple[str, list[str], str]],
) -> OpSchema:
    attributes = [OpSchema.Attribute(n, t, d, required=True) for n, t, d in attrs]
    attributes += [OpSchema.Attribute(n, t, d, required=False) for n, t, d in _PLUGIN_ATTRS]
    return OpSchema(
        name,
        DOMAIN,
        VERSION,
        doc,
        inputs=[_param(*p) for p in inputs],
        outputs=[_param(*p) for p in outputs],
        type_constraints=type_constraints,
        attributes=attributes,
    )


def schemas() -> list[OpSchema]:
    """The plugin-node schemas, TP collectives included (see docs/ENGINE_FORMAT.md for the semantics)."""
    index_types = [("I", _INTS, "per-request int32/int64 metadata"), ("B", _INTS, "block table ids")]
    return [
        _schema(
            KV_WRITE,
            "Varlen paged KV write into the pool at pool_ptr, in place. Output: rows stored.",
            [
                ("k", "T", "[T, Hkv, D]"),
                ("v", "T", "[T, Hkv, D]"),
                ("counts", "I", "[R]"),
                ("starts", "I", "[R]"),
                ("block_tables", "B", "[R, max_blocks]"),
                ("pool_ptr", _ADDRESS, "[1] pool address"),
            ],
            [("written", _ADDRESS, "[1] rows stored")],
            KV_WRITE_ATTRS,
            [("T", _FLOATS, "row type"), *index_types],
        ),  # fmt: skip
        _schema(
            PAGED_ATTENTION,
            "Varlen paged causal GQA attention over the pool at pool_ptr; `after` orders it after a KvWrite.",
            [
                ("q", "T", "[T, Hq, D]"),
                ("q_counts", "I", "[R]"),
                ("kv_lens", "I", "[R]"),
                ("block_tables", "B", "[R, max_blocks]"),
                ("pool_ptr", _ADDRESS, "[1] pool address"),
                ("after", _ADDRESS, "[1] a KvWrite output (ordering only)"),
            ],
            [("out", "T", "[T, Hq, D]")],
            PAGED_ATTENTION_ATTRS,
            [("T", _FLOATS, "query/output type"), *index_types],
        ),  # fmt: skip
        _schema(
            MOE_EXPERTS,
            "Routed experts: sum_k w[t,k] * down(silu(gate(x_t)) * up(x_t)); ep_size > 1 exchanges tokens.",
            [
                ("x", "T", "[T, H]"),
                ("topk_ids", "I", "[T, K] global expert ids"),
                ("topk_weights", "W", "[T, K]"),
                ("w_gate_up", "T", "[E_local, 2*I, H]"),
                ("w_down", "T", "[E_local, H, I]"),
            ],
            [("out", "T", "[T, H]")],
            MOE_EXPERTS_ATTRS,
            [("T", _FLOATS, "activation/weight type"), ("I", _INTS, "expert ids"), ("W", _FLOATS, "weights")],
        ),  # fmt: skip
        *collective_schemas(),
    ]


def mla_schemas() -> list[OpSchema]:
    """The two MLA latent-KV node schemas (docs/ENGINE_FORMAT.md "MlaKvWrite", "MlaPagedAttention")."""
    index_types = [("I", _INTS, "per-request int32/int64 metadata"), ("B", _INTS, "block table ids")]
    return [
        _schema(
            MLA_KV_WRITE,
            "Varlen paged write of MLA latent rows [k_pe ; c_kv] into the pool at pool_ptr, in place. Output: rows "
            "stored.",
            [
                ("latent", "T", "[T, latent_dim]"),
                ("counts", "I", "[R]"),
                ("starts", "I", "[R]"),
                ("block_tables", "B", "[R, max_blocks]"),
                ("pool_ptr", _ADDRESS, "[1] pool address"),
                ("inv_freq", "F", "[rope_dim / 2] rope inverse frequencies (read only when rope_dim > 0)"),
            ],
            [("written", _ADDRESS, "[1] rows stored")],
            MLA_KV_WRITE_ATTRS,
            [("T", _FLOATS, "row type"), *index_types, ("F", ["tensor(float)"], "inverse frequencies")],
        ),  # fmt: skip
        _schema(
            MLA_PAGED_ATTENTION,
            "Varlen paged causal absorbed-MLA attention over the latent pool at pool_ptr (keys = latent, values = "
            "c_kv); `after` orders it after an MlaKvWrite.",
            [
                ("q", "T", "[T, H, latent_dim] absorbed queries"),
                ("q_counts", "I", "[R]"),
                ("kv_lens", "I", "[R]"),
                ("block_tables", "B", "[R, max_blocks]"),
                ("pool_ptr", _ADDRESS, "[1] pool address"),
                ("after", _ADDRESS, "[1] an MlaKvWrite output (ordering only)"),
            ],
            [("out", "T", "[T, H, latent_dim - rope_dim]")],
            MLA_PAGED_ATTENTION_ATTRS,
            [("T", _FLOATS, "query/output type"), *index_types],
        ),  # fmt: skip
    ]


def register_schemas() -> None:
    """Register the schemas with onnx (idempotent: already-registered ones are left alone)."""
    for schema in [*schemas(), *mla_schemas()]:
        if not onnx.defs.has(schema.name, DOMAIN):
            onnx.defs.register_schema(schema)


def _opset() -> Any:
    import onnxscript

    return onnxscript.values.Opset(DOMAIN, VERSION)


def _plugin_attrs() -> dict[str, str]:
    return {"plugin_namespace": DOMAIN, "plugin_version": PLUGIN_VERSION}


def _kv_write(k, v, counts, starts, block_tables, pool_ptr, plane: int, num_planes: int, num_blocks: int,
              block_size: int, num_kv_heads: int, head_dim: int, dtype: int, rope_dim: int, rope_theta: float):  # fmt: skip
    return _opset().KvWrite(
        k, v, counts, starts, block_tables, pool_ptr,
        plane=plane, num_planes=num_planes, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, rope_dim=rope_dim,
        rope_theta=float(rope_theta), **_plugin_attrs(),
    )  # fmt: skip


def _paged_attention(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane: int, num_planes: int,
                     num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: int, scale: float):  # fmt: skip
    return _opset().PagedAttention(
        q, q_counts, kv_lens, block_tables, pool_ptr, after,
        plane=plane, num_planes=num_planes, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, scale=float(scale), **_plugin_attrs(),
    )  # fmt: skip


def _moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, num_experts: int, ep_size: int, tp_size: int = 1,
                 tp_rank: int = 0):  # fmt: skip
    return _opset().MoeExperts(
        x, topk_ids, topk_weights, w_gate_up, w_down, num_experts=num_experts, ep_size=ep_size, tp_size=tp_size,
        tp_rank=tp_rank, **_plugin_attrs(),
    )  # fmt: skip


def _mla_kv_write(latent, counts, starts, block_tables, pool_ptr, inv_freq, plane: int, num_planes: int,
                  num_blocks: int, block_size: int, latent_dim: int, dtype: int, rope_dim: int, rope_scale: float):  # fmt: skip
    return _opset().MlaKvWrite(
        latent, counts, starts, block_tables, pool_ptr, inv_freq,
        plane=plane, num_planes=num_planes, num_blocks=num_blocks, block_size=block_size, latent_dim=latent_dim,
        dtype=dtype, rope_dim=rope_dim, rope_scale=float(rope_scale), **_plugin_attrs(),
    )  # fmt: skip


def _mla_paged_attention(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane: int, num_planes: int,
                         num_blocks: int, block_size: int, latent_dim: int, dtype: int, rope_dim: int, scale: float):  # fmt: skip
    return _opset().MlaPagedAttention(
        q, q_counts, kv_lens, block_tables, pool_ptr, after,
        plane=plane, num_planes=num_planes, num_blocks=num_blocks, block_size=block_size, latent_dim=latent_dim,
        dtype=dtype, rope_dim=rope_dim, scale=float(scale), **_plugin_attrs(),
    )  # fmt: skip


def custom_translation_table() -> dict[Any, Callable[..., Any]]:
    """`custom_translation_table=` for `torch.onnx.export(..., dynamo=True)`; registers the schemas first."""
    import plugins.mla_ops  # noqa: F401  (defines torch.ops.mtp.mla_*)
    import plugins.ops  # noqa: F401  (defines torch.ops.mtp.*)

    register_schemas()
    return {
        torch.ops.mtp.kv_write.default: _kv_write,
        torch.ops.mtp.paged_attention.default: _paged_attention,
        torch.ops.mtp.moe_experts.default: _moe_experts,
        # MLA latent KV (plugins/mla_ops.py)
        torch.ops.mtp.mla_kv_write.default: _mla_kv_write,
        torch.ops.mtp.mla_paged_attention.default: _mla_paged_attention,
        **collective_translations(),
    }


# --- Tensor-parallel collectives: AllReduce / AllGather (plugins/collectives.py; ENGINE_FORMAT "Collective nodes").
COLLECTIVE_ATTRS: list[tuple[str, OpSchema.AttrType, str]] = [("tp_size", _INT, "ranks in the TP group (> 1)")]


def collective_schemas() -> list[OpSchema]:
    """AllReduce (sum over the TP comm) and AllGather (concatenate along the last axis, rank order)."""
    floats = [("T", _FLOATS, "element type")]
    return [
        _schema(_names.ALL_REDUCE, "Sum of x over the TP group; same shape and type.", [("x", "T", "[...]")],
                [("y", "T", "[...]")], COLLECTIVE_ATTRS, floats),
        _schema(_names.ALL_GATHER, "x of every TP rank concatenated along the last axis, in rank order.",
                [("x", "T", "[..., N]")], [("y", "T", "[..., tp_size * N]")], COLLECTIVE_ATTRS, floats),
    ]  # fmt: skip


def _all_reduce(x, tp_size: int):
    return _opset().AllReduce(x, tp_size=tp_size, **_plugin_attrs())


def _all_gather(x, tp_size: int):
    return _opset().AllGather(x, tp_size=tp_size, **_plugin_attrs())


def collective_translations() -> dict[Any, Callable[..., Any]]:
    import plugins.collectives  # noqa: F401  (defines torch.ops.mtp.all_reduce / all_gather)

    return {torch.ops.mtp.all_reduce.default: _all_reduce, torch.ops.mtp.all_gather.default: _all_gather}
