"""The compiled CPU artifact of a rank: one AOTInductor package (`.pt2`) per engine graph.

Each graph wrapper of builder/graphs.py is traced with `torch.export` (the same named dynamic dims as the ONNX
export: `tokens`, `requests`, `max_blocks`, ... so one package serves every batch and row count) and compiled
ahead of time by Inductor into C++ with the weights inside. The plugin ops (`mtp::kv_write`,
`mtp::paged_attention`, `mtp::moe_experts`, MLA ops) stay opaque calls through the torch dispatcher, whatever
kernel is registered under their names; the pool travels by address, so the compiled code never sees (or
copies) the pool: only the dense parts are generated code.

Weights: `weights="checkpoint"` stores every matrix whose values are bf16 numbers (a bf16 checkpoint's, loaded
as fp32) as bf16 inside the package and upcasts it next to its use, so the math stays fp32 and exact
(`bf16_weights`); "float32" stores fp32 weights. `choose_weights` picks one per rank: bf16 only while the rank's
weights fit in the last-level cache (docs/PERFORMANCE.md "Compiled engine" and "Realistic size" have what each
costs: the generated upcast copies every weight per step, which is cheap from cache and ruinous from DRAM).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from builder.export import dynamic_shapes
from builder.graphs import SPECS, WRAPPERS, example_inputs
from builder.options import BuildError
from models.engine_format.compiled import AOTI_KIND, host_isa
from models.glm4_moe import Glm4MoeMTPModel
from plugins.kv_pool import KVPoolGeometry

# Inductor settings of every package (recorded in config.json). Freezing folds weights into constants and
# prepacks the fp32 GEMMs for MKL; it would fold a bf16->fp32 upcast into fp32 constants, so bf16 weights
# build without it (docs/PERFORMANCE.md "Compiled engine": Weights; the choice measured there).
INDUCTOR_FLOAT32: dict[str, Any] = {"freezing": True}
INDUCTOR_BF16: dict[str, Any] = {"freezing": False}


def export_program(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int):
    """torch.export of graph `name` with the contract's dynamic dims (plugin ops run as their fake impls)."""
    wrapper = WRAPPERS[name](model, geom).eval()
    args = example_inputs(name, model.cfg.hidden_size, max_blocks)
    with torch.no_grad():
        return torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes(SPECS[name]), strict=False)


def bf16_weights(program: torch.export.ExportedProgram) -> int:
    """Store every fp32 weight whose values are all bf16 numbers as bf16 and upcast it at its uses: the math
    is unchanged bit for bit, the package holds (and a step reads) half the bytes. Weights are the program's
    parameters and lifted constants (the fused QKV / gate|up tensors are plain attributes, hence constants).
    Returns how many tensors changed."""
    sig = program.graph_signature
    graph = program.graph_module.graph
    changed = 0
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
        low = value.detach().to(torch.bfloat16)
        store[key] = torch.nn.Parameter(low, requires_grad=False) if store is program.state_dict else low
        node.meta["val"] = node.meta["val"].to(torch.bfloat16)
        changed += 1
        # the experts op reads bf16 weights itself (no fp32 copy of every expert per step); others get an upcast
        dense_users = [u for u in node.users if u.target is not torch.ops.mtp.moe_experts.default]
        if not dense_users:
            continue
        with graph.inserting_after(node):
            up = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float32})
        up.meta["val"] = node.meta["val"].to(torch.float32)
        for user in dense_users:
            user.replace_input_with(node, up)
    graph.lint()
    program.graph_module.recompile()
    return changed


def choose_weights(weight_bytes_bf16: int, cache_bytes: int) -> str:
    """"checkpoint" (bf16-exact weights stored bf16) while they fit in the last-level cache, else "float32".

    Measured (docs/PERFORMANCE.md): models/deep (22 MB in bf16) runs 1.2x faster at batch 8 with bf16 weights; the
    realistic-size checkpoint (1.65 GB) ran 573.9 ms per token with bf16 weights and 121.9 ms with fp32 ones,
    because each bf16 weight is copied into a fresh fp32 buffer every step. cache_bytes <= 0: unknown, keep bf16.
    """
    return "checkpoint" if cache_bytes <= 0 or weight_bytes_bf16 <= cache_bytes else "float32"


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
    """The weight storage of this rank's packages (`choose_weights` for its matrices and this machine's cache)."""
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    return choose_weights(2 * matrices, last_level_cache_bytes())


def compile_graph(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, path: Path,
                  weights: str) -> dict[str, Any]:  # fmt: skip
    """Export + AOTInductor-compile graph `name` into the package `path`; returns what was done (for config.json)."""
    try:
        program = export_program(name, model, geom, max_blocks)
        converted = bf16_weights(program) if weights == "checkpoint" else 0
        options = INDUCTOR_BF16 if converted else INDUCTOR_FLOAT32
        quiet = io.StringIO()
        logging.getLogger("torch._inductor").setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(options))
    except BuildError:
        raise
    except Exception as e:  # export and Inductor raise many types; name the graph and keep the cause
        raise BuildError(f"AOTInductor compile of graph {name!r} failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}; build without --compile or report it") from e  # fmt: skip
    return {"bf16_weights": converted, "inductor": options}


def compile_rank(model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, rdir: Path, work: Path,
                 graphs: dict[str, dict[str, str]], weights: str) -> dict[str, Any]:  # fmt: skip
    """Compile every graph of this rank next to its ONNX files; adds `aoti` paths to `graphs`."""
    info: dict[str, Any] = {}
    for name in graphs:
        path = rdir / f"{name}.{AOTI_KIND}.pt2"
        info[name] = compile_graph(name, model, geom, max_blocks, path, weights)
        graphs[name][AOTI_KIND] = str(path.relative_to(work))
    return {"graphs": info, "isa": host_isa(), "torch_version": torch.__version__, "weights": weights}
