"""One spec per plugin op: the single place that says what an op takes and returns.

An `OpSpec` names the torch op (`mtp::<op>`) and the graph node (`<Node>`, ONNX domain `mtp` = the TensorRT plugin
namespace), and lists the tensor inputs with their dtype class, the attributes (the torch op's trailing ints and
floats, in order) and the outputs, plus the shape rule. Everything else is derived from it by
plugins/op_backends.py: the torch schema and fake, the ONNX schema and the exporter's translation, the ONNX Runtime
binding, and the TensorRT plugins' format checks (plugins/_trt_impl.py). Adding an op is one `OpSpec` here plus
its kernels; adding a backend is one derivation in op_backends.py. The node contracts are documented field by
field in docs/ENGINE_FORMAT.md ("Plugin nodes").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plugins.names import (
    ALL_GATHER,
    ALL_REDUCE,
    DSA_INDEX_TOPK,
    DSA_SPARSE_ATTENTION,
    GDN_STEP,
    KV_WRITE,
    LINEAR_BF16,
    MLA_KV_WRITE,
    MLA_PAGED_ATTENTION,
    MOE_EXPERTS,
    PAGED_ATTENTION,
    SWA_PAGED_ATTENTION,
)

# Dtype classes of a tensor input or output. Each backend maps a class to what it supports:
#   ONNX              TensorRT               ONNX Runtime (Python ops: one fixed type)
FLOAT = "float"  # float32 | float16 | bfloat16, one type var per op  same as input 0     float32
INDEX = "index"  # int32 | int64 (per-request metadata, block tables) int32 | int64     int32
INT64 = "int64"  # int64 only (pool address, expert ids, counters)   int64               int64
FP32 = "fp32"  # float32 only (rope inverse frequencies)           float32             float32
DTYPE_CLASSES = (FLOAT, INDEX, INT64, FP32)


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    dtype: str  # one of DTYPE_CLASSES
    shape: str  # documentation: "[T, Hkv, D]"
    type_var: str = ""  # ONNX type variable of a FLOAT tensor ("T" unless another float type is allowed)
    # An address the op writes through, in place (a pool). In-place inputs are addresses, never tensors, in every
    # backend: ONNX Runtime Python ops get copies of their tensor inputs (a write to one would be lost) and an ONNX
    # node cannot alias an input to an output. So the mutation is in the contract as "writes through this int64[1]
    # address", the same for torch, ONNX, ONNX Runtime and TensorRT.
    writes: bool = False
    optional: bool = False  # may be None (torch `Tensor?`, an ONNX optional input)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CLASSES:
            raise ValueError(f"tensor {self.name}: dtype class {self.dtype!r} is not one of {DTYPE_CLASSES}")
        if self.writes and (self.dtype != INT64 or not self.name.endswith("_ptr")):
            raise ValueError(f"tensor {self.name}: an input written in place is an int64[1] address named *_ptr "
                             "(the pool itself is never a node input)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Attr:
    name: str
    kind: type  # int or float
    doc: str
    default: int | float | None = None  # torch default (trailing attributes only)


@dataclass(frozen=True, slots=True)
class OpSpec:
    op: str  # torch.ops.mtp.<op>
    node: str  # ONNX / TensorRT node name
    doc: str
    inputs: tuple[Tensor, ...]
    attrs: tuple[Attr, ...]
    outputs: tuple[Tensor, ...]
    shape: Callable[..., torch.Tensor]  # the fake: shape(*inputs, **attrs) -> the output (fake tensors)
    tensorrt: bool = True  # has a TensorRT plugin (plugins/trt_plugins.py)

    @property
    def torch_schema(self) -> str:
        """The torch schema, e.g. `kv_write(Tensor k, ..., int plane, ..., float rope_theta) -> Tensor`."""
        args = [f"Tensor{'?' if t.optional else ''} {t.name}" for t in self.inputs]
        for a in self.attrs:
            kind = "int" if a.kind is int else "float"
            args.append(f"{kind} {a.name}" + ("" if a.default is None else f"={a.default}"))
        out = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join("Tensor" for _ in self.outputs) + ")"
        return f"{self.op}({', '.join(args)}) -> {out}"

    @property
    def written(self) -> tuple[str, ...]:
        """The inputs the op writes through in place (pool addresses)."""
        return tuple(t.name for t in self.inputs if t.writes)


SPECS: dict[str, OpSpec] = {}  # by torch op name; `register` adds, plugins/op_backends.py `install` derives


def register(spec: OpSpec) -> OpSpec:
    if spec.op in SPECS and SPECS[spec.op] != spec:
        raise ValueError(f"op {spec.op!r} is specified twice")
    SPECS[spec.op] = spec
    return spec


def _written(*inputs, **attrs) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


def _like_first(x, *inputs, **attrs) -> torch.Tensor:
    return torch.empty_like(x)


def _int(name: str, doc: str) -> Attr:
    return Attr(name, int, doc)


_PLANE = _int("plane", "pool plane this node reads/writes")
_POOL = (
    _int("num_planes", "pool geometry: planes"),
    _int("num_blocks", "pool geometry: blocks per plane (block 0 is the null block)"),
    _int("block_size", "pool geometry: positions per block"),
)
_GQA_POOL = (*_POOL, _int("num_kv_heads", "pool geometry: KV heads"), _int("head_dim", "pool geometry: head dimension"),
             _int("dtype", "pool element type: 0 fp32, 1 fp16, 2 bf16"))  # fmt: skip
_MLA_POOL = (*_POOL, _int("latent_dim", "pool geometry: latent row = qk_rope_head_dim + kv_lora_rank values"),
             _int("dtype", "pool element type: 0 fp32, 1 fp16, 2 bf16"))  # fmt: skip
_TABLES = Tensor("block_tables", INDEX, "[R, max_blocks]")
_POOL_PTR = Tensor("pool_ptr", INT64, "[1] pool address (written in place)", writes=True)
_READ_POOL_PTR = Tensor("pool_ptr", INT64, "[1] pool address")
_WRITTEN = Tensor("written", INT64, "[1] rows stored")

register(OpSpec(
    "kv_write", KV_WRITE, "Varlen paged KV write into the pool at pool_ptr, in place. Output: rows stored.",
    (Tensor("k", FLOAT, "[T, Hkv, D]"), Tensor("v", FLOAT, "[T, Hkv, D]"), Tensor("counts", INDEX, "[R]"),
     Tensor("starts", INDEX, "[R]"), _TABLES, _POOL_PTR),
    (_PLANE, *_GQA_POOL, _int("rope_dim", "rope K's first rope_dim dims at the write position; 0 = off"),
     Attr("rope_theta", float, "rope base")),
    (_WRITTEN,), _written,
))  # fmt: skip
register(OpSpec(
    "paged_attention", PAGED_ATTENTION,
    "Varlen paged causal GQA attention over the pool at pool_ptr; `after` orders it after a KvWrite.",
    (Tensor("q", FLOAT, "[T, Hq, D]"), Tensor("q_counts", INDEX, "[R]"), Tensor("kv_lens", INDEX, "[R]"), _TABLES,
     _READ_POOL_PTR, Tensor("after", INT64, "[1] a KvWrite output (ordering only)")),
    (_PLANE, *_GQA_POOL, Attr("scale", float, "softmax scale applied to q.k")),
    (Tensor("out", FLOAT, "[T, Hq, D]"),), _like_first,
))  # fmt: skip
register(OpSpec(
    "swa_paged_attention", SWA_PAGED_ATTENTION,
    "PagedAttention's sliding-window mode: query position q sees keys q - window + 1 .. q (window 0: all), and each "
    "query head's sink logit joins its softmax denominator (plugins/reference_swa.py).",
    (Tensor("q", FLOAT, "[T, Hq, D]"), Tensor("q_counts", INDEX, "[R]"), Tensor("kv_lens", INDEX, "[R]"), _TABLES,
     _READ_POOL_PTR, Tensor("after", INT64, "[1] a KvWrite output (ordering only)"),
     Tensor("sinks", FP32, "[Hq] per-head sink logits")),
    (_PLANE, *_GQA_POOL, Attr("scale", float, "softmax scale applied to q.k"),
     _int("window", "keys seen per query, the query included (transformers' sliding_window); 0 = all")),
    (Tensor("out", FLOAT, "[T, Hq, D]"),), _like_first,  # TensorRT plugin type-checked only (docs/MODELS.md)
))  # fmt: skip
register(OpSpec(
    "moe_experts", MOE_EXPERTS,
    "Routed experts: sum_k w[t,k] * down(silu(gate(x_t)) * up(x_t)); ep_size > 1 exchanges tokens.",
    (Tensor("x", FLOAT, "[T, H]"), Tensor("topk_ids", INT64, "[T, K] global expert ids"),
     Tensor("topk_weights", FLOAT, "[T, K]", type_var="W"), Tensor("w_gate_up", FLOAT, "[E_local, 2*I, H]"),
     Tensor("w_down", FLOAT, "[E_local, H, I]")),
    (_int("num_experts", "global number of routed experts"),
     _int("ep_size", "expert-parallel group size; this rank holds num_experts/ep_size experts"),
     Attr("tp_size", int, "tensor-parallel group size; > 1: the output is this rank's partial sum", 1),
     Attr("tp_rank", int, "this rank's place in its TP group = its expert column", 0)),
    (Tensor("out", FLOAT, "[T, H]"),), _like_first, tensorrt=False,  # its ep_size > 1 form needs NCCL
))  # fmt: skip
register(OpSpec(
    "mla_kv_write", MLA_KV_WRITE,
    "Varlen paged write of MLA latent rows [k_pe ; c_kv] into the pool at pool_ptr, in place. Output: rows stored.",
    (Tensor("latent", FLOAT, "[T, latent_dim]"), Tensor("counts", INDEX, "[R]"), Tensor("starts", INDEX, "[R]"),
     _TABLES, _POOL_PTR, Tensor("inv_freq", FP32, "[rope_dim / 2] rope inverse frequencies")),
    (_PLANE, *_MLA_POOL, _int("rope_dim", "rope the latent's first rope_dim dims at the write position; 0 = off"),
     Attr("rope_scale", float, "YaRN attention factor multiplying cos and sin (1.0 = none)")),
    (_WRITTEN,), _written,
))  # fmt: skip
register(OpSpec(
    "mla_paged_attention", MLA_PAGED_ATTENTION,
    "Varlen paged causal absorbed-MLA attention over the latent pool at pool_ptr (keys = latent, values = c_kv); "
    "`after` orders it after an MlaKvWrite.",
    (Tensor("q", FLOAT, "[T, H, latent_dim] absorbed queries"), Tensor("q_counts", INDEX, "[R]"),
     Tensor("kv_lens", INDEX, "[R]"), _TABLES, _READ_POOL_PTR, Tensor("after", INT64, "[1] an MlaKvWrite output")),
    (_PLANE, *_MLA_POOL, _int("rope_dim", "values are latent[:, rope_dim:] (c_kv)"),
     Attr("scale", float, "softmax scale applied to q.latent")),
    (Tensor("out", FLOAT, "[T, H, latent_dim - rope_dim]"),),
    lambda q, *_, latent_dim, rope_dim, **__: q.new_empty(q.shape[0], q.shape[1], latent_dim - rope_dim),
))  # fmt: skip

# DeepSeek Sparse Attention (plugins/dsa_ops.py; semantics plugins/dsa_reference.py). Both only read the pool; the model
# orders them after the writes they read by a data dependency on their float input (models/dsa.py `_after`).
register(OpSpec(
    "dsa_index_topk", DSA_INDEX_TOPK,
    "The lightning indexer's selection: per query row its topk best visible positions by sum_h w[h] relu(scale * "
    "q[h] . k[s]) over the indexer keys (the first q.size(2) values of each row of `plane`); int64, ascending, -1 = "
    "unused.",
    (Tensor("q", FP32, "[T, heads, dim] indexer queries"), Tensor("weights", FP32, "[T, heads] per-head weights"),
     Tensor("q_counts", INDEX, "[R]"), Tensor("kv_lens", INDEX, "[R]"), _TABLES, _READ_POOL_PTR),
    (_int("plane", "the indexer-key plane this node reads"), *_POOL,
     _int("row_dim", "pool geometry: row width (the latent_dim of the MLA pool)"),
     _int("dtype", "pool element type: 0 fp32, 1 fp16, 2 bf16"), _int("topk", "positions kept per row"),
     Attr("scale", float, "index score scale (index_head_dim ** -0.5)")),
    (Tensor("selected", INT64, "[T, topk] positions, -1 = unused"),),
    lambda q, *_, topk, **__: q.new_empty(q.shape[0], topk, dtype=torch.int64),  # TensorRT: type-checked only
))  # fmt: skip
register(OpSpec(
    "dsa_sparse_attention", DSA_SPARSE_ATTENTION,
    "Absorbed MLA attention of each row over its selected positions of latent plane `plane` (keys = latent, values "
    "= c_kv).",
    (Tensor("q", FLOAT, "[T, H, latent_dim] absorbed queries"), Tensor("q_counts", INDEX, "[R]"),
     Tensor("selected", INT64, "[T, topk] a DsaIndexTopk output"), _TABLES, _READ_POOL_PTR),
    (_PLANE, *_MLA_POOL, _int("rope_dim", "values are latent[:, rope_dim:] (c_kv)"),
     Attr("scale", float, "softmax scale applied to q.latent")),
    (Tensor("out", FLOAT, "[T, H, latent_dim - rope_dim]"),),
    lambda q, *_, latent_dim, rope_dim, **__: q.new_empty(q.shape[0], q.shape[1], latent_dim - rope_dim),
    # TensorRT plugin type-checked only: no GPU has run it (docs/MODELS.md "DSA")
))  # fmt: skip

register(OpSpec(
    "gdn_step", GDN_STEP,
    "One Gated DeltaNet layer's token mixing over the state pool (plugins/reference.py gdn_step_ref): reads each "
    "request's read slot (zeros where starts == 0), writes the state after row t to write_slots[t] (-1: none), in "
    "place through conv_pool_ptr / ssm_pool_ptr; a request with 0 rows reads and writes nothing. Output: the core "
    "output (before the gated norm), float32.",
    (Tensor("mixed", FLOAT, "[T, conv_dim] conv input rows (q, k, v channels)"), Tensor("b", FLOAT, "[T, Hv]"),
     Tensor("a", FLOAT, "[T, Hv]"), Tensor("q_counts", INDEX, "[R]"),
     Tensor("starts", INDEX, "[R] first position (0: a fresh sequence)"),
     Tensor("read_slots", INDEX, "[R] slot each request starts from"),
     Tensor("write_slots", INDEX, "[T] slot receiving the state after each row, -1 = not stored"),
     Tensor("conv_pool_ptr", INT64, "[1] conv pool address (written in place)", writes=True),
     Tensor("ssm_pool_ptr", INT64, "[1] ssm pool address (written in place)", writes=True),
     Tensor("conv_weight", FLOAT, "[conv_dim, conv_kernel]"), Tensor("a_log", FLOAT, "[Hv]"),
     Tensor("dt_bias", FLOAT, "[Hv]")),
    (_int("layer", "GDN layer of the state pool this node reads/writes"),
     _int("num_layers", "pool geometry: GDN layers"), _int("num_slots", "pool geometry: state slots"),
     _int("conv_dim", "pool geometry: conv channels = 2 * Hk * Dk + Hv * Dv"),
     _int("conv_kernel", "pool geometry: conv kernel K (the window holds K - 1 inputs)"),
     _int("num_k_heads", "key heads Hk"), _int("num_v_heads", "value heads Hv"), _int("head_k_dim", "Dk"),
     _int("head_v_dim", "Dv"), _int("dtype", "conv pool element type: 0 fp32, 1 fp16, 2 bf16 (ssm: fp32)")),
    (Tensor("out", FP32, "[T, Hv, Dv] float32"),),
    lambda mixed, *_, num_v_heads, head_v_dim, **__: mixed.new_empty(mixed.shape[0], num_v_heads, head_v_dim,
                                                                     dtype=torch.float32),
))  # fmt: skip

register(OpSpec(
    "linear_bf16", LINEAR_BF16,
    "x @ weight^T + bias with the weight read as bf16 and fp32 math (exact: bf16 -> fp32 is a shift); the compiled "
    "engine's dense linears over bf16-stored weights (builder/compile_aoti.py).",
    (Tensor("x", FP32, "[..., K]"), Tensor("weight", FLOAT, "[N, K] bf16, row-major", type_var="W"),
     Tensor("bias", FP32, "[N]", optional=True)),
    (), (Tensor("y", FP32, "[..., N]"),),
    lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])),
    tensorrt=False,  # CPU only: AOTInductor packages call it; TensorRT has its own GEMMs
))  # fmt: skip


# Tensor-parallel collectives (plugins/collectives.py: mpi4py on CPU, numpy kernels for ONNX Runtime too;
# plugins/trt_collectives.py: NCCL).
_TP_SIZE = _int("tp_size", "ranks in the TP group (> 1)")
register(OpSpec(
    "all_reduce", ALL_REDUCE, "Sum of x over the TP group; same shape and type.",
    (Tensor("x", FLOAT, "[...]"),), (_TP_SIZE,), (Tensor("y", FLOAT, "[...]"),), _like_first,
    tensorrt=False,  # its TensorRT plugin is plugins/trt_collectives.py (NCCL)
))  # fmt: skip
register(OpSpec(
    "all_gather", ALL_GATHER, "x of every TP rank concatenated along the last axis, in rank order.",
    (Tensor("x", FLOAT, "[..., N]"),), (_TP_SIZE,), (Tensor("y", FLOAT, "[..., tp_size * N]"),),
    lambda x, tp_size: x.new_empty((*x.shape[:-1], x.shape[-1] * tp_size)), tensorrt=False,
))  # fmt: skip


def by_node(node: str) -> OpSpec:
    return next(s for s in SPECS.values() if s.node == node)


FLOAT_TYPES = ("float32", "float16", "bfloat16")


def accepts(spec: OpSpec, pos: int, types: list[str]) -> bool:
    """Whether position `pos` of (inputs + outputs) may have dtype types[pos], given the dtypes at the positions
    before it (TensorRT asks position by position: supports_format_combination). Names: FLOAT_TYPES, int32, int64."""
    tensors = (*spec.inputs, *spec.outputs)
    t, dtype = tensors[pos], types[pos]
    if t.dtype == INDEX:
        return dtype in ("int32", "int64")
    if t.dtype == INT64:
        return dtype == "int64"
    if t.dtype == FP32:
        return dtype == "float32"
    first = next(i for i, u in enumerate(tensors) if u.dtype == FLOAT and u.type_var == t.type_var)
    return dtype in FLOAT_TYPES if first == pos else dtype == types[first]
