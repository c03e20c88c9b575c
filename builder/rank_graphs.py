"""Ranks that export the same graph: one ONNX export per distinct graph, the other ranks' files by weight swap.

Why: the ONNX export (torch.onnx, dynamo) is most of a multi-rank build's time, and ranks that differ only in which
weights they hold trace to the same graph. The models read three fields of a rank's mapping to shape their graphs
(`tp`, `tp_rank`, `ep`: head and column shards, the collectives' attributes, the local expert count; `graph_key`
keeps every field but the ones that pick weights); `rank`, `dp_rank`, `ep_rank` and the expert range only choose
which slices `load_model` reads (models/sharding.py). So the experts' ranks of an EP-only build share one graph,
and a DP x TP build has one graph per TP position, shared by its DP groups.

The first rank of each key exports (the template); a later rank with its key writes each graph as the template's
graph proto with its own weights in place (`swap_weights`): byte for byte what its own export writes
(tests/builder/test_rank_graphs.py). A graph is swapped only when the template's export holds each model tensor it
names as a plain copy (`swappable`) and every tensor in which the two ranks differ is one of those initializers
(`fits`): a tensor the exporter folded into a new constant is then the same on both ranks, so the constant is
too. Otherwise the rank exports that graph itself, as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import torch
from onnxscript.optimizer._constant_folding import DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT as FOLD_INPUT_LIMIT
from torch import nn

from builder.graphs import wrapper
from models.glm4_moe import Glm4MoeMTPModel
from plugins.gdn_pool import GDNPoolGeometry
from plugins.kv_pool import KVPoolGeometry
from plugins.mapping import RankMapping

_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE,
           onnx.TensorProto.FLOAT8E4M3FN}  # fmt: skip
# onnx TensorProto data types of the torch dtypes a graph's weights can have
_ONNX_DTYPE = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
               torch.int32: onnx.TensorProto.INT32, torch.int8: onnx.TensorProto.INT8,
               torch.uint8: onnx.TensorProto.UINT8, torch.bool: onnx.TensorProto.BOOL,
               torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN}  # fmt: skip


def graph_key(mapping: RankMapping) -> RankMapping:
    """What of a rank's mapping shapes its graphs: the mapping without the fields that only select its weights."""
    return dataclasses.replace(mapping, rank=0, dp_rank=0, ep_rank=0, expert_lo=0, expert_hi=0)


def templates(mappings: Sequence[RankMapping]) -> list[int | None]:
    """For each rank, the first earlier rank whose graphs are its own (None: it exports them itself)."""
    first: dict[RankMapping, int] = {}
    out: list[int | None] = []
    for rank, mapping in enumerate(mappings):
        out.append(first.get(graph_key(mapping)))
        first.setdefault(graph_key(mapping), rank)
    return out


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a graph module holds, by the name the exporter gives its initializer: parameters, buffers and
    plain tensor attributes (the fused QKV / gate|up weights, lifted as constants), by dotted path."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, value in vars(mod).items():
            if isinstance(value, torch.Tensor):
                out[dot + name] = value
        for store in (mod._parameters, mod._buffers):
            out.update({dot + name: t for name, t in store.items() if t is not None})
    return out


def graph_tensors(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry,
                  state: GDNPoolGeometry | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The tensors of graph `name`'s module (builder/graphs.py), by their initializer names."""
    return module_tensors(wrapper(name, model, geom, state))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _matches(init: onnx.TensorProto, t: torch.Tensor) -> bool:
    return list(init.dims) == list(t.shape) and _ONNX_DTYPE.get(t.dtype) == init.data_type


def _external(init: onnx.TensorProto) -> tuple[str, int, int] | None:
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in init.external_data}
    return info["location"], int(info.get("offset", 0)), int(info.get("length", -1))


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> sha256 of the tensor's bytes: what a rank compares with its template's to find what differs."""
    return {name: hashlib.sha256(_tensor_bytes(t)).hexdigest() for name, t in tensors.items()}


def swappable(path: Path, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether the exported graph at `path` holds `tensors` (the module it was exported from) as plain copies under
    their names: each initializer that names one of them has exactly its shape, type and bytes."""
    model = onnx.load(str(path), load_external_data=False)
    with open(path.with_name(path.name + ".data"), "rb") as data:
        for init in model.graph.initializer:
            t = tensors.get(init.name)
            if t is None:
                continue
            where = _external(init)
            if not _matches(init, t) or (where is not None and (where[0] != path.name + ".data" or where[2] < 0)):
                return False
            if where is None:
                stored = init.raw_data
            else:
                data.seek(where[1])
                stored = data.read(where[2])
            if stored != _tensor_bytes(t):
                return False
    return True


def fits(template: Path, template_digests: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether this rank (its graph module's `tensors`) may write the template's graph with its weights swapped in:
    the same tensor names, and no constant of the graph can come from a tensor in which the two ranks differ.

    Such a tensor is either an initializer of the graph under its own name (swapped), or one the graph does not
    read directly: unused (the main graph's MTP experts), or folded by the exporter's constant folding into a new
    constant. The folding (onnxscript) takes no input over FOLD_INPUT_LIMIT elements except into a Transpose, whose
    output is as large; so when every such tensor is larger than that and no float constant of the graph is, none
    of the graph's constants comes from one of them."""
    if set(tensors) != set(template_digests):
        return False
    model = onnx.load(str(template), load_external_data=False)
    names = {init.name for init in model.graph.initializer}
    if any(init.data_type in _FLOATS and _numel(init.dims) > FOLD_INPUT_LIMIT
           for init in model.graph.initializer if init.name not in tensors):  # fmt: skip
        return False
    return all(name in names or t.numel() > FOLD_INPUT_LIMIT for name, t in tensors.items()
               if digests({name: t})[name] != template_digests[name])  # fmt: skip


def _numel(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def swap_weights(template: Path, out: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write graph `out` (+ its `.data`) as the template graph with `tensors` (this rank's) in place of the
    template rank's under the same names; the template must be `swappable` and the rank must `fit` it. Returns the
    data file's path."""
    model = onnx.load(str(template), load_external_data=False)
    data_name = out.name + ".data"
    if data_name != template.name + ".data":
        raise ValueError(f"{out.name} and {template.name} name different graphs")
    src_data = template.with_name(template.name + ".data")
    shutil.copyfile(src_data, out.with_name(data_name))
    with open(out.with_name(data_name), "r+b") as data:
        for init in model.graph.initializer:
            t = tensors.get(init.name)
            if t is None:
                continue
            if not _matches(init, t):
                raise ValueError(f"{init.name}: {list(t.shape)} {t.dtype} does not fit the template's "
                                 f"{list(init.dims)} (type {init.data_type})")  # fmt: skip
            where = _external(init)
            if where is None:
                init.raw_data = _tensor_bytes(t)
            else:
                data.seek(where[1])
                data.write(_tensor_bytes(t))
    onnx.save(model, str(out))
    return out.with_name(data_name)
