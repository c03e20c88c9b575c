"""Cross-checks of config.json against itself and against the graphs it names.

The checksums prove the files are the ones the build wrote; these prove the config describes them. A
config whose `kv.block_size` differs from the plugin nodes' (a hand edit re-sealed into the manifest, or a
builder bug) would size the pool and block tables wrong: the ops then index past the pool (a segfault) or
silently read other slots. The graph checks read the ONNX protos without their weights (cheap).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from onnx.helper import tensor_dtype_to_np_dtype

from models.config import ModelConfig, kv_geometry_fields, num_kv_planes
from models.engine_format.config import EngineConfig
from models.engine_format.graph_io import engine_graphs, graph_spec
from models.engine_format.layout import KVLayout, StateLayout, table_width
from models.engine_format.paths import EngineDirError, rank_dir
from plugins.kv_pool import DTYPE_CODES
from plugins.mapping import MappingError, RankMapping, check_model, local_kv_heads, rank_mapping
from plugins.names import DSA_INDEX_TOPK, GDN_STEP, LATENT_POOL_NODES, MOE_EXPERTS, POOL_NODES

_FIX = "the config does not describe the graphs it ships with; rebuild with `mtp-build --checkpoint CKPT --output {}`"
# Graph files the checks read (a TensorRT plan is opaque here: its recorded profiles are checked instead).
_ONNX_KINDS = ("onnx", "ort_optimized")


def _refuse(cfg: EngineConfig, what: str) -> EngineDirError:
    return EngineDirError(f"engine {cfg.path}: {what}; {_FIX.format(cfg.path)}")


def check_consistent(cfg: EngineConfig) -> None:
    """config.json's fields agree with each other and with the model (no file is read)."""
    kv, lim, k, m = cfg.kv, cfg.limits, cfg.num_draft_tokens, cfg.model
    _check_mapping(cfg)
    width = table_width(lim.max_seq_len, k, kv.block_size)
    want = {
        "kv.table_width": (kv.table_width, width),
        "kv.num_planes": (kv.num_planes, num_kv_planes(m)),
        **{f"kv.{name}": (getattr(kv, name), value) for name, value in _pool_rows(m, cfg.parallel.tp_size).items()},
    }
    dtype = getattr(torch, cfg.dtype, None)
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_CODES:
        want["kv.dtype_code"] = (kv.dtype_code, DTYPE_CODES[dtype])
    else:
        raise _refuse(cfg, f"dtype {cfg.dtype!r} is not one of float32, float16, bfloat16")
    for name, (got, expected) in want.items():
        if got != expected:
            raise _refuse(cfg, f"{name}={got} but the model and limits give {expected}")
    if not 0 <= k < kv.block_size:
        raise _refuse(cfg, f"num_draft_tokens={k} must be in [0, kv.block_size={kv.block_size})")
    if kv.num_blocks < 2:
        raise _refuse(cfg, f"kv.num_blocks={kv.num_blocks}: the pool needs the null block 0 plus one block")
    if lim.max_num_tokens < lim.max_batch * (1 + k):
        raise _refuse(cfg, f"limits.max_num_tokens={lim.max_num_tokens} < max_batch*(1+K)={lim.max_batch * (1 + k)}")
    expected_graphs = set(engine_graphs(m))  # a per-module family: one draft graph per MTP module
    for rank, per_graph in enumerate(cfg.graphs):
        if set(per_graph) != expected_graphs:
            raise _refuse(cfg, f"{rank_dir(rank)} has graphs {sorted(per_graph)}, expected {sorted(expected_graphs)}")
    if k and not m.num_mtp_modules:
        raise _refuse(cfg, f"num_draft_tokens={k} but the model has no MTP module")
    _check_state(cfg)
    _check_profiles(cfg)


def _check_state(cfg: EngineConfig) -> None:
    """`state` exists exactly for hybrid models and is the pool the model, limits and K give (models/gdn.py)."""
    m = cfg.model
    if cfg.state is None:
        if m.is_hybrid:
            raise _refuse(cfg, f"{m.model_type} has Gated DeltaNet layers but config.json records no `state` pool")
        return
    if not m.is_hybrid:
        raise _refuse(cfg, f"config.json records a `state` pool but {m.model_type} has no Gated DeltaNet layers")
    from models.gdn import state_geometry  # models/ imports are heavy, keep them lazy

    dtype = getattr(torch, cfg.dtype)
    want = StateLayout.plan(state_geometry(m, 0, dtype, cfg.parallel.tp_size), cfg.limits.max_batch,
                            cfg.num_draft_tokens)  # fmt: skip
    for name in want.__dataclass_fields__:
        got, expected = getattr(cfg.state, name), getattr(want, name)
        if got != expected:
            raise _refuse(cfg, f"state.{name}={got} but the model, limits and num_draft_tokens give {expected}")


def _pool_rows(m: ModelConfig, tp_size: int = 1) -> dict[str, int]:
    """The kv fields the model fixes: the pool kind and the row shape one rank holds (the same rule the builder
    and the torch executor size their pools with: models/config.py `kv_geometry_fields` + `local_kv_heads`)."""
    heads, head_dim, kind = kv_geometry_fields(m)
    return {"kv_kind": kind, "num_kv_heads": local_kv_heads(heads, tp_size), "head_dim": head_dim}


def _check_profiles(cfg: EngineConfig) -> None:
    """TensorRT profiles recorded at build time admit every block-table width and batch the limits allow."""
    plans = cfg.build.get("tensorrt", {}).get("plans", {}) if cfg.backend == "tensorrt" else {}
    for key, plan in plans.items():
        for prof in plan.get("profiles", []):
            for dim, hi in (("max_blocks", cfg.kv.table_width), ("requests", cfg.limits.max_batch)):
                if dim in prof and prof[dim][2] < hi:
                    raise _refuse(cfg, f"plan {key} caps {dim} at {prof[dim][2]} but the limits need {hi}")


def check_against_graphs(cfg: EngineConfig) -> None:
    """Every ONNX graph file declares the I/O contract and plugin attributes the config implies."""
    for rank, per_graph in enumerate(cfg.graphs):
        for graph in per_graph:
            for kind in _ONNX_KINDS:
                path = cfg.graph_file(rank, graph, kind)
                if path is not None:
                    _check_graph(cfg, graph, path, f"{rank_dir(rank)}/{path.name}", rank)


def _check_graph(cfg: EngineConfig, graph: str, path: Path, label: str, rank: int = 0) -> None:
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and others for a file that is not a model
        raise _refuse(cfg, f"{label} is not a readable ONNX model ({type(e).__name__})") from e
    spec = graph_spec(graph, cfg.model.is_hybrid)
    g = model.graph
    for kind, values, names in (("inputs", g.input, spec.inputs), ("outputs", g.output, spec.outputs)):
        got = tuple(v.name for v in values)
        if got != names:
            raise _refuse(cfg, f"{label} has {kind} {got}, the contract is {names}")
        for v in values:
            tt = v.type.tensor_type
            dtype = tensor_dtype_to_np_dtype(tt.elem_type).name
            dims = tuple(d.dim_param or d.dim_value for d in tt.shape.dim)
            want = spec.concrete_dims(v.name, cfg.model.hidden_size, cfg.model.vocab_size)
            if dtype != spec.dtypes[v.name] or dims != want:
                raise _refuse(cfg, f"{label} declares {v.name} {dtype}{list(dims)}, the config implies "
                                   f"{spec.dtypes[v.name]}{list(want)}")  # fmt: skip
    mapping = rank_mapping(rank, cfg.parallel, cfg.model.n_routed_experts if cfg.model.has_moe else 0)
    moe = {"num_experts": cfg.model.n_routed_experts, "ep_size": cfg.parallel.ep_size, "tp_size": mapping.tp,
           "tp_rank": mapping.tp_rank}  # fmt: skip
    _check_shards(cfg, g, label, mapping)
    for node in g.node:
        problem = node_mismatch(cfg.kv, moe, node) or state_node_mismatch(cfg.state, node)
        if problem is not None:
            raise _refuse(cfg, f"{label}: {problem}")


def state_node_mismatch(state: StateLayout | None, node: onnx.NodeProto) -> str | None:
    """Why a GdnStep node disagrees with config.json's `state` (the pool it indexes by raw offsets), or None."""
    if node.op_type != GDN_STEP:
        return None
    if state is None:
        return "GdnStep node in an engine whose config.json records no `state` pool"
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    want = state.geometry().attrs(attrs.get("layer", -1))
    for name, value in want.items():
        if attrs.get(name) != value:
            field = "state.dtype_code" if name == "dtype" else "the layer index" if name == "layer" else f"state.{name}"
            return f"GdnStep node was built with {name}={attrs.get(name)} but config.json gives {field}={value}"
    if not 0 <= attrs["layer"] < state.num_layers:
        return f"GdnStep node reads/writes layer {attrs['layer']} outside the state pool's {state.num_layers} layers"
    return None


def node_mismatch(kv: KVLayout, moe: dict[str, int], node: onnx.NodeProto) -> str | None:
    """Why a plugin node's attributes disagree with config.json's `kv` (or the MoE fields), or None.

    GQA pool nodes carry num_kv_heads and head_dim; MLA and DSA nodes (MlaKvWrite, MlaPagedAttention, DsaIndexTopk,
    DsaSparseAttention) only exist for an MLA pool (kv.kv_kind 1) and carry the latent row length as latent_dim
    (DsaIndexTopk: row_dim) (= kv.head_dim).
    """
    if node.op_type == MOE_EXPERTS:
        want, fields = moe, {name: name for name in moe}
    elif node.op_type in POOL_NODES:
        mla = node.op_type in LATENT_POOL_NODES
        if mla != (kv.kv_kind == 1):
            pool = "an MLA latent pool (kv.kv_kind=1)" if kv.kv_kind == 1 else "a GQA K/V pool (kv.kv_kind=0)"
            return f"{node.op_type} node in an engine whose config.json gives {pool}"
        row = "row_dim" if node.op_type == DSA_INDEX_TOPK else "latent_dim"
        rows = {row: kv.head_dim} if mla else {"num_kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim}
        want = {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "num_planes": kv.num_planes, **rows,
                "dtype": kv.dtype_code}  # fmt: skip
        fields = {name: "kv.head_dim" if name == row else "kv.dtype_code" if name == "dtype" else f"kv.{name}"
                  for name in want}  # fmt: skip
    else:
        return None
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    for name, value in want.items():
        if attrs.get(name) != value:
            return (f"{node.op_type} node was built with {name}={attrs.get(name)} but config.json gives "
                    f"{fields[name]}={value}")  # fmt: skip
    if node.op_type in POOL_NODES and not 0 <= attrs.get("plane", -1) < kv.num_planes:
        return f"{node.op_type} node writes plane {attrs.get('plane')} outside the pool"
    return None


# --- Tensor-parallel mapping: `parallel` is a mapping the contract allows, and each rank's graph holds its shards.
def _check_mapping(cfg: EngineConfig) -> None:
    p, m = cfg.parallel, cfg.model
    try:
        check_model(p.world_size, p.ep_size, p.tp_size, num_experts=m.n_routed_experts if m.has_moe else 0,
                    num_heads=m.num_attention_heads, num_kv_heads=m.num_key_value_heads, vocab_size=m.vocab_size,
                    mla=m.is_mla, gdn_key_heads=m.linear_num_key_heads if m.is_hybrid else 0)  # fmt: skip
    except MappingError as e:
        raise _refuse(cfg, f"parallel={p}: {e}") from None
    if len(cfg.graphs) != p.world_size:
        raise _refuse(cfg, f"{len(cfg.graphs)} rank graph sets for parallel.world_size={p.world_size}")


def _check_shards(cfg: EngineConfig, g: onnx.GraphProto, label: str, mapping: RankMapping) -> None:
    """Initializers named like canonical weights have the shape models/sharding.py gives this rank (a rank
    built with another rank's or the full tensor would compute garbage, or fail deep in a GEMM)."""
    from models.checkpoint_hybrid import model_class  # the full shapes; models/ imports are heavy, keep them lazy
    from models.sharding import local_shape

    if not _FULL_SHAPES or _FULL_SHAPES[0][0] is not cfg.model:
        with torch.device("meta"):
            full = {k: tuple(v.shape) for k, v in model_class(cfg.model)(cfg.model).state_dict().items()}
        _FULL_SHAPES[:] = [(cfg.model, full)]
    full = _FULL_SHAPES[0][1]
    for init in g.initializer:
        name = init.name.removeprefix("model.")  # the graph wrappers hold the model as `.model`
        if name in full:
            want = local_shape(name, full[name], cfg.model, mapping)
            got = tuple(init.dims)
            if got != want:
                raise _refuse(cfg, f"{label}: weight {init.name} has shape {list(got)}, rank {mapping.rank}'s shard "
                                   f"under parallel={cfg.parallel} is {list(want)}")  # fmt: skip


_FULL_SHAPES: list[tuple[object, dict[str, tuple[int, ...]]]] = []  # (model config, full shapes) of the last check
