"""ONNX export of the engine graphs: torch.onnx.export(dynamo=True) over the wrappers of builder/graphs.py.

Owns how a graph becomes a `.onnx` + `.onnx.data` pair: the plugin translation table, named dynamic axes
(shared dims use one `torch.export.Dim`, so e.g. every per-request input has the same `requests` axis), and
external weight data (one data file per graph, next to it).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import onnx
import torch

from builder.graphs import example_inputs, wrapper
from builder.options import BuildError
from models.engine_format.graph_io import GraphSpec, graph_spec
from models.glm4_moe import Glm4MoeMTPModel
from plugins.gdn_pool import GDNPoolGeometry
from plugins.kv_pool import KVPoolGeometry
from plugins.onnx_export import custom_translation_table


def dynamic_shapes(spec: GraphSpec) -> dict[str, dict[int, torch.export.Dim] | None]:
    dims: dict[str, torch.export.Dim] = {}
    out: dict[str, dict[int, torch.export.Dim] | None] = {}
    for inp in spec.inputs:
        axes = spec.dynamic[inp]
        out[inp] = {ax: dims.setdefault(sym, torch.export.Dim(sym)) for ax, sym in axes.items()} or None
    return out


def export_graph(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, path: Path,
                 state: GDNPoolGeometry | None = None) -> Path:  # fmt: skip
    """Export graph `name` to `path` (weights to `path.name + '.data'`); returns the data file's path.

    state: the GDN state pool of a hybrid model (its main graph's GdnStep nodes carry this geometry)."""
    spec = graph_spec(name, state is not None)
    module = wrapper(name, model, geom, state).eval()
    args = example_inputs(name, model.cfg.hidden_size, max_blocks, state is not None)
    # The exporter reports progress on stdout/logging; the builder shows its own progress instead.
    quiet = io.StringIO()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, dynamo=True, custom_translation_table=custom_translation_table(),
                input_names=list(spec.inputs), output_names=list(spec.outputs),
                dynamic_shapes=dynamic_shapes(spec), verbose=False,
            )  # fmt: skip
    except Exception as e:  # the exporter raises many types; name the graph and keep the cause
        raise BuildError(f"ONNX export of graph {name!r} failed: {type(e).__name__}: {e}") from e
    if program is None:
        raise BuildError(f"ONNX export of graph {name!r} returned no program")
    program.save(str(path), external_data=True)
    data = path.with_name(path.name + ".data")
    if not data.is_file():
        raise BuildError(f"ONNX export of {name!r} wrote no external data file {data.name}")
    _check_io(name, spec, path)
    return data


def _check_io(name: str, spec: GraphSpec, path: Path) -> None:
    """The exported names must be exactly the contract's: the executors bind them by name."""
    m = onnx.load(str(path), load_external_data=False)
    inputs = tuple(i.name for i in m.graph.input)
    outputs = tuple(o.name for o in m.graph.output)
    if inputs != spec.inputs or outputs != spec.outputs:
        raise BuildError(
            f"graph {name!r} exported with I/O {inputs} -> {outputs}, contract is {spec.inputs} -> {spec.outputs} "
            "(an input the model does not use is dropped by the exporter; builder/graphs.py must use them all)"
        )
