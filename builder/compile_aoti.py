"""The compiled CPU artifact of a rank: one AOTInductor package (`.pt2`) per engine graph.

Each graph wrapper of builder/graphs.py is traced with `torch.export` (the same named dynamic dims as the ONNX
export: `tokens`, `requests`, `max_blocks`, ... so one package serves every batch and row count) and compiled
ahead of time by Inductor into C++ with the weights inside. The plugin ops (`mtp::kv_write`,
`mtp::paged_attention`, `mtp::moe_experts`, MLA ops) stay opaque calls through the torch dispatcher, whatever
kernel is registered under their names; the pool travels by address, so the compiled code never sees (or
copies) the pool: only the dense parts are generated code.

Weights: `weights="checkpoint"` stores every matrix whose values are bf16 numbers (a bf16 checkpoint's, loaded
as fp32) as bf16 inside the package (`bf16_weights`); the dense linears call `mtp::linear_bf16` and the routed
experts `mtp::moe_experts`, which read bf16 and compute in fp32, so the math stays fp32 and exact and no weight
is copied per step. "float32" stores fp32 weights. `choose_weights` falls back to fp32 for a graph only if the
weights it would still upcast per step (uses no bf16-reading op serves) overflow the last-level cache
(docs/PERFORMANCE.md "Compiled engine" and "Realistic size": an upcast from DRAM is ruinous).

FP8 checkpoints keep their FP8 dense weights (read by `mtp::linear_fp8` / `mtp::moe_experts_fp8`) and `--quantize int8`
stores the dense linears and the routed experts int8 (`mtp::linear_int8` / `mtp::moe_experts_int8`), `--quantize int4`
those whose input widths the group divides int4 (`mtp::linear_int4` / `mtp::moe_experts_int4`):
builder/quantized_weights.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from builder.export import dynamic_shapes
from builder.fused_draft import export_fused
from builder.graphs import example_inputs, wrapper
from builder.options import INT4_GROUP_DEFAULT, BuildError
from builder.quantized_weights import (
    INT8_KEPT_FLOAT,
    INT8_KEPT_FLOAT_BUT_HEAD,
    LINEAR,
    fp8_weights,
    int4_weights,
    int8_weights,
)
from models.engine_format.compiled import AOTI_KIND, FP8_FORMAT, INT4_FORMAT, INT8_FORMAT, host_isa
from models.engine_format.graph_io import DRAFT_GRAPH, FUSED_DRAFT, FUSED_KIND, graph_spec
from models.engine_format.layout import SNAPSHOTS_PER_REQUEST
from models.fp8 import Fp8Weight
from models.glm4_moe import Glm4MoeMTPModel
from plugins.gdn_pool import GDNPoolGeometry
from plugins.kv_pool import KVPoolGeometry

# Inductor settings of every package (recorded in config.json). Freezing folds weights into constants and
# prepacks the fp32 GEMMs for MKL; it would fold a bf16->fp32 upcast into fp32 constants, so bf16 weights
# build without it (docs/PERFORMANCE.md "Compiled engine": Weights; the choice measured there).
INDUCTOR_FLOAT32: dict[str, Any] = {"freezing": True}
INDUCTOR_BF16: dict[str, Any] = {"freezing": False}
# Where every package keeps its weights: beside its code, as one pickled tensor per weight (data/weights/ of the .pt2),
# not inside the .so. From the .so, AOTInductor's loader copied each weight into a heap blob and the .so's own pages of
# it stayed mapped too: 2.03x the weight bytes resident. From data/weights the loader (models/engine_format/compiled.py
# load_package) hands the loaded tensors to the package as they are (`user_managed`): 1.03x
# (tests/builder/test_package_memory.py; models/deep's engine: peak RSS of mtp-run 508 -> 482 MB for 28 MB of weights).
# The build then moves them out of the packages into one store per rank, each weight once (builder/pool_weights.py).
PACKAGE_WEIGHTS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False,
                                   "aot_inductor.package_constants_on_disk_format": "pickle_weights"}  # fmt: skip


def export_program(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int,
                   state: GDNPoolGeometry | None = None):  # fmt: skip
    """torch.export of graph `name` with the contract's dynamic dims (plugin ops run as their fake impls). state: a
    hybrid model's GDN state pool (its main graph takes the state slots and the pools' addresses)."""
    module = wrapper(name, model, geom, state).eval()
    args = example_inputs(name, model.cfg.hidden_size, max_blocks, state is not None)
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes(graph_spec(name, state is not None)),
                                   strict=False)  # fmt: skip


_UPCASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


def _weight_source(node: torch.fx.Node, low: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node | None:
    """The bf16 placeholder a linear's weight argument is, through fp32 upcasts (`.float()`), or None."""
    while node not in low:
        if node.target not in _UPCASTS or not isinstance(node.args[0], torch.fx.Node):
            return None
        node = node.args[0]
    return low[node]


def bf16_weights(program: torch.export.ExportedProgram) -> dict[str, int]:
    """Store every fp32 weight whose values are all bf16 numbers as bf16 [N, K] row-major; the math stays fp32 and
    exact (bf16 -> fp32 is a shift). Weights are the program's parameters and lifted constants (the fused QKV /
    gate|up tensors are plain attributes, hence constants). Their uses:
      * dense linears (attention projections, MLPs, shared experts, lm_head, the router's `.float()` linear)
        become `mtp::linear_bf16`, which reads the bf16 weight directly: no fp32 copy of any weight per step;
      * the routed experts' `mtp::moe_experts` reads bf16 itself; an embedding gathers bf16 rows, then upcasts;
      * anything else gets an upcast next to its use (a per-step fp32 copy: counted in `upcast_bytes`).
    Returns {"bf16_weights": tensors stored bf16, "bf16_linears": linears rewritten, "upcast_bytes": bf16 bytes
    still upcast per step}."""
    sig = program.graph_signature
    graph = program.graph_module.graph
    low: dict[torch.fx.Node, torch.fx.Node] = {}  # converted placeholder (and its upcast) -> the placeholder
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        if node.name in sig.inputs_to_parameters:
            store, key = program.state_dict, sig.inputs_to_parameters[node.name]
        elif node.name in sig.inputs_to_lifted_tensor_constants:
            store, key = program.constants, sig.inputs_to_lifted_tensor_constants[node.name]
        else:
            continue
        value = store[key]
        if value.dtype != torch.float32 or value.dim() < 2 or not torch.equal(value.bfloat16().float(), value):
            continue
        # row-major [N, K] (the model keeps linears stored [K, N] for MKL): the layout linear_bf16 streams
        bf16 = value.detach().contiguous().to(torch.bfloat16)
        store[key] = torch.nn.Parameter(bf16, requires_grad=False) if store is program.state_dict else bf16
        node.meta["val"] = node.meta["val"].to(torch.bfloat16).contiguous()
        low[node] = node
        for user in list(node.users):
            if user.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.erase_node(user)  # export's check that the weight is fp32: no longer true, by design
            elif user.target is torch.ops.aten.embedding.default and user.args[0] is node:
                with graph.inserting_after(user):
                    up = graph.call_function(torch.ops.aten._to_copy.default, (user,), {"dtype": torch.float32})
                user.replace_all_uses_with(up, delete_user_cb=lambda u, up=up: u is not up)
                up.meta["val"] = user.meta["val"]
                user.meta["val"] = user.meta["val"].to(torch.bfloat16)
        dense_users = [u for u in node.users if u.target is not torch.ops.mtp.moe_experts.default
                       and u.target is not torch.ops.aten.embedding.default]  # fmt: skip
        if dense_users:
            with graph.inserting_after(node):
                up = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float32})
            up.meta["val"] = node.meta["val"].to(torch.float32)
            for user in dense_users:
                user.replace_input_with(node, up)
            low[up] = node
    linears = 0
    for node in list(graph.nodes):
        if node.target is not LINEAR or not isinstance(node.args[1], torch.fx.Node):
            continue
        x, weight = node.args[0], _weight_source(node.args[1], low)
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if weight is None or weight.meta["val"].dim() != 2 or x.meta["val"].dtype != torch.float32:
            continue
        if bias is not None and bias.meta["val"].dtype != torch.float32:
            continue
        with graph.inserting_before(node):
            op = graph.call_function(torch.ops.mtp.linear_bf16.default, (x, weight, bias))
        op.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(op)
        graph.erase_node(node)
        linears += 1
    for node in reversed(list(graph.nodes)):  # upcasts the rewrite left unused (now dead code)
        if node.target in _UPCASTS and not node.users:
            graph.erase_node(node)
    left = set(graph.nodes)
    upcast = sum(2 * up.meta["val"].numel() for up in low if up.op != "placeholder" and up in left)
    graph.lint()
    program.graph_module.recompile()
    return {"bf16_weights": sum(1 for n in low if n.op == "placeholder"), "bf16_linears": linears,
            "upcast_bytes": upcast}  # fmt: skip


def weight_bytes(program: torch.export.ExportedProgram) -> int:
    """Bytes of the weights the package stores: the parameters, buffers and constants the graph uses (the program
    lists every parameter of the model; AOTInductor keeps only the used ones)."""
    sig, total = program.graph_signature, 0
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder" and node.users and node.name in names:
            t = program.state_dict.get(names[node.name], program.constants.get(names[node.name]))
            total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    return total


def choose_weights(upcast_bytes_bf16: int, cache_bytes: int) -> str:
    """"checkpoint" (bf16-exact weights stored bf16) unless the weights a graph would still upcast per step (those
    no bf16-reading op serves: `bf16_weights`' upcast_bytes) overflow the last-level cache: then "float32".

    Measured (docs/PERFORMANCE.md "Realistic size"): a per-step upcast of 1.65 GB of weights from DRAM ran 574 ms per
    token against 122 ms for fp32 weights; `mtp::linear_bf16` reads them as bf16 with no copy, so GLM-shaped graphs
    upcast nothing and stay bf16 at every size. cache_bytes <= 0: unknown, keep bf16.
    """
    return "checkpoint" if cache_bytes <= 0 or upcast_bytes_bf16 <= cache_bytes else "float32"


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the highest cache level Linux reports for CPU 0 (0 when it does not say)."""
    best = (0, 0)
    for index in sysfs.glob("index*"):
        try:
            level, text = int((index / "level").read_text()), (index / "size").read_text().strip()
            size = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    return best[1]


def model_weights(model: Glm4MoeMTPModel) -> str:
    """The weight storage this rank's packages start from: "checkpoint" when some matrix holds bf16 numbers (each
    graph then keeps it unless `choose_weights` says otherwise for what it still upcasts), else "float32"."""
    exact = any(p.dim() >= 2 and torch.equal(p.detach().bfloat16().float(), p.detach()) for p in model.parameters())
    return "checkpoint" if exact else "float32"


def compile_graph(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, path: Path,
                  weights: str, fp8: Mapping[str, Fp8Weight] | None = None,
                  quantize: str = "none", lm_head: bool = False, int4_group: int = INT4_GROUP_DEFAULT,
                  state: GDNPoolGeometry | None = None,
                  export: Callable[[], torch.export.ExportedProgram] | None = None) -> dict[str, Any]:  # fmt: skip
    """Export + AOTInductor-compile graph `name` into the package `path`; returns what was done (for config.json).
    fp8: the rank's FP8 weights as released (models.checkpoint.load_fp8_weights), stored FP8 where a linear uses them.
    quantize "int8": the dense linears' and routed experts' (multi-rank: this rank's) weights stored int8
    (`int8_weights`); "int4": the dense linears and routed experts whose input widths the group divides stored int4
    (`int4_weights`), the rest of int8's weights int8;
    lm_head: the LM head too, int8 (with either). int4_group: int4's group size (input features per scale).
    state: a hybrid model's GDN state pool, with the slot count the package bakes in (`compiled_state`).
    export: makes the program instead of `export_program` (a module that is not an engine graph, compiled exactly
    as one: builder/fused_draft.py); `name` then only names it in errors."""
    if export is None:
        export = lambda: export_program(name, model, geom, max_blocks, state)  # noqa: E731

    def convert(program: torch.export.ExportedProgram, bf16: bool) -> dict[str, Any]:
        stats: dict[str, Any] = (fp8_weights(program, fp8) if fp8
                                 else {"fp8_weights": 0, "fp8_linears": 0, "fp8_experts": 0})  # fmt: skip
        if quantize == "int4":
            stats.update(int4_weights(program, group=int4_group))  # first: int8_weights then takes only the fp32 weights left
        if quantize in ("int8", "int4"):
            stats.update(int8_weights(program, kept_float=INT8_KEPT_FLOAT_BUT_HEAD if lm_head else INT8_KEPT_FLOAT))
        return {**stats, **(bf16_weights(program) if bf16 else {"bf16_weights": 0})}

    try:
        program = export()
        stats = convert(program, weights == "checkpoint")
        if stats["bf16_weights"] and choose_weights(stats["upcast_bytes"], last_level_cache_bytes()) == "float32":
            program = export()  # the per-step upcasts would cost more than fp32
            stats = {**convert(program, False), "upcast_bytes_refused": stats["upcast_bytes"]}
        stats["weight_bytes"] = weight_bytes(program)
        options = INDUCTOR_BF16 if stats["bf16_weights"] else INDUCTOR_FLOAT32
        quiet = io.StringIO()
        logging.getLogger("torch._inductor").setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                     inductor_configs={**options, **PACKAGE_WEIGHTS})  # fmt: skip
    except BuildError:
        raise
    except Exception as e:  # export and Inductor raise many types; name the graph and keep the cause
        raise BuildError(f"AOTInductor compile of graph {name!r} failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}; build without --compile or report it") from e  # fmt: skip
    return {**stats, "weights": "checkpoint" if stats["bf16_weights"] else "float32",
            "inductor": {**options, **PACKAGE_WEIGHTS}}  # fmt: skip


def compiled_state(state: GDNPoolGeometry, max_batch: int) -> GDNPoolGeometry:
    """The GDN state pool a compiled hybrid engine's packages bake in: the request slots (config.json `state`) plus
    the default prefix-cache snapshots (SNAPSHOTS_PER_REQUEST x max_batch). The slot count sets every layer's
    address in the pool, so it cannot be rewritten at load as the ONNX graphs' is; a run may use fewer snapshots."""
    return dataclasses.replace(state, num_slots=state.num_slots + SNAPSHOTS_PER_REQUEST * max_batch)


def compile_rank(model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, rdir: Path, work: Path,
                 graphs: dict[str, dict[str, str]], weights: str,
                 track: Callable[[Sequence[str], str], Iterable[str]] = lambda items, what: items,
                 fp8: Mapping[str, Fp8Weight] | None = None,
                 quantize: Callable[[str], str] = lambda graph: "none", lm_head: bool = False,
                 int4_group: int = INT4_GROUP_DEFAULT, state: GDNPoolGeometry | None = None,
                 fused: Sequence[int] = ()) -> dict[str, Any]:  # fmt: skip
    """Compile every graph of this rank next to its ONNX files; adds `aoti` paths to `graphs`. fused: the MTP module
    of each depth of the fused draft loop (builder/fused_draft.py; empty: none), compiled as mtp_draft is and added
    to mtp_draft's entry as kind FUSED_KIND. `track` shows the
    graphs as a progress bar (the builder's reporter); each graph's compile time goes into its record. fp8: the
    rank's FP8 weights as released; when some graph stores them, the record's `fp8` says how (FP8_FORMAT).
    quantize(graph) -> "none" | "int8" | "int4" (BuildOptions.graph_quantize: the MTP module's graphs may stay float);
    "int8": the record's `int8` says how (INT8_FORMAT), with the op and the quantized weights' names; "int4": also
    `int4` (INT4_FORMAT) for the weights stored int4. `quantized_graphs` names the graphs that were. lm_head: their LM
    head int8 too (`--quantize-lm-head`); int4_group: int4's group size (`--int4-group-size`, in the record). state: a
    hybrid model's GDN state pool as the packages bake it (`compiled_state`); its slot count goes in the record
    (`state_slots`: the compiled executor allocates exactly that many)."""
    info: dict[str, Any] = {}
    for name in track(list(graphs), "AOTInductor compile"):
        path = rdir / f"{name}.{AOTI_KIND}.pt2"
        t0 = time.perf_counter()
        info[name] = compile_graph(name, model, geom, max_blocks, path, weights, fp8, quantize(name), lm_head,
                                   int4_group, state)  # fmt: skip
        info[name]["seconds"] = round(time.perf_counter() - t0, 1)
        graphs[name][AOTI_KIND] = str(path.relative_to(work))
    if fused:
        path, t0 = rdir / f"{DRAFT_GRAPH}.{FUSED_KIND}.pt2", time.perf_counter()
        info[FUSED_DRAFT] = compile_graph(FUSED_DRAFT, model, geom, max_blocks, path, weights, fp8, quantize(DRAFT_GRAPH),
                                          lm_head, int4_group,
                                          export=partial(export_fused, model, geom, max_blocks, fused))  # fmt: skip
        info[FUSED_DRAFT]["seconds"] = round(time.perf_counter() - t0, 1)
        graphs[DRAFT_GRAPH][FUSED_KIND] = str(path.relative_to(work))
    record: dict[str, Any] = {"graphs": info, "isa": host_isa(), "torch_version": torch.__version__, "weights": weights}
    if state is not None:
        record["state_slots"] = state.num_slots
    # a multi-rank graph's quantized experts call their format's exchange op (builder/quantized_weights.py)
    exchange = "_exchange" if model.mapping.ep > 1 or model.mapping.tp > 1 else ""
    ops = [op for op, n in (("linear_fp8", "fp8_linears"), (f"moe_experts_fp8{exchange}", "fp8_experts"))
           if any(g[n] for g in info.values())]  # fmt: skip
    if ops:
        record["fp8"] = {**FP8_FORMAT, "ops": ops}
    int8_names = sorted({w for g in info.values() for w in g.pop("int8_names", [])})
    if int8_names:
        ops = [op for op, n in (("linear_int8", "int8_linears"), (f"moe_experts_int8{exchange}", "int8_experts"))
               if any(g.get(n) for g in info.values())]  # fmt: skip
        record["int8"] = {**INT8_FORMAT, "ops": ops, "weights": int8_names}
    if any(quantize(name) != "none" for name in info):
        record["quantized_graphs"] = [name for name in info if quantize(name) != "none"]
    int4_names = sorted({w for g in info.values() for w in g.pop("int4_names", [])})
    if int4_names:
        ops = [op for op, n in (("linear_int4", "int4_linears"), (f"moe_experts_int4{exchange}", "int4_experts"))
               if any(g.get(n) for g in info.values())]  # fmt: skip
        record["int4"] = {**INT4_FORMAT, "group_size": int4_group, "ops": ops, "weights": int4_names}
    return record
