"""The onnxruntime backend: ORT-optimized copies of each graph, made with the session options the runtime uses.

Owns `optimize_graph`. The session options (`SESSION_OPTIONS`, recorded in config.json under
build.ort_session_options and applied by runtime/executors/ort_executor.py) are engine format:
models/engine_format/ort_session.py. The optimized copy is written by ORT itself
(SessionOptions.optimized_model_filepath) with the plugin library registered, so it keeps the plugin nodes
(in domain ai.onnx.contrib, which only ORT needs) and its weights go to an external file, which
`share_weights` replaces by the original graph's own weights file when the bytes are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx
import onnxruntime as ort

from models.engine_format.ort_session import SESSION_OPTIONS, session_options
from plugins.ort_ops import prepare_for_ort


def optimize_graph(onnx_path: Path) -> tuple[Path | None, str]:
    """Write `<name>.ort.onnx` (+ `.data`) next to `onnx_path`. Returns (path or None, note for config.json)."""
    out = onnx_path.with_name(onnx_path.stem + ".ort.onnx")
    so = session_options(SESSION_OPTIONS, onnx_path.parent)
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", out.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    model = prepare_for_ort(onnx.load(str(onnx_path), load_external_data=False))
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=SESSION_OPTIONS["providers"])
    except Exception as e:  # ORT raises its own exception types; a refused serialization only loses the copy
        for f in (out, out.with_name(out.name + ".data")):
            f.unlink(missing_ok=True)
        return None, f"ORT could not save an optimized copy ({type(e).__name__}: {e}); the runtime optimizes at load"
    if not out.is_file():
        return None, "ORT wrote no optimized copy; the runtime optimizes at load"
    note = "saved by ORT with the plugin library registered (plugin nodes in domain ai.onnx.contrib)"
    own = share_weights(onnx_path, out)
    if own is not None:
        note += (f"; its weights are {onnx_path.name}.data's" if own == 0 else
                 f"; {own} bytes of weights ORT changed are its own, the rest are {onnx_path.name}.data's")  # fmt: skip
    return out, note


def share_weights(onnx_path: Path, optimized: Path) -> int | None:
    """Point the optimized copy's weights at the original graph's weights file wherever ORT wrote the same bytes
    under the same name (at our optimization level nearly all of them: it folds or drops a few small ones), and
    keep in ORT's own file only the tensors it changed or made. An engine then holds its weights once on disk
    instead of twice. Returns the bytes left in ORT's file (0: dropped), None when there was nothing to share."""
    ours, theirs = onnx_path.with_name(onnx_path.name + ".data"), optimized.with_name(optimized.name + ".data")
    if not (ours.is_file() and theirs.is_file()):
        return None
    original = {t.name: _where(t) for t in _tensors(onnx.load(str(onnx_path), load_external_data=False).graph)
                if t.data_location == onnx.TensorProto.EXTERNAL}  # fmt: skip
    model = onnx.load(str(optimized), load_external_data=False)
    if any(_where(t)[2] < 0 for t in _tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL):
        return None  # a tensor without an explicit length: leave ORT's file as it wrote it
    kept = bytearray()  # the tensors ORT changed or made, as its new file
    with open(ours, "rb") as f_ours, open(theirs, "rb") as f_theirs:
        for tensor in _tensors(model.graph):
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            offset, length = _where(tensor)[1:]
            data = _read(f_theirs, offset, length)
            same = original.get(tensor.name)
            if same is not None and same[0] == ours.name and same[2] == length and _read(f_ours, same[1], length) == data:
                _point(tensor, ours.name, same[1], length)
            else:
                _point(tensor, theirs.name, len(kept), length)
                kept += data
    tmp = optimized.with_name(optimized.name + ".tmp")
    onnx.save(model, str(tmp))
    if kept:
        theirs.write_bytes(bytes(kept))
    tmp.replace(optimized)
    if not kept:
        theirs.unlink()
    return len(kept)


def _where(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0)), int(info.get("length", -1))


def _read(f, offset: int, length: int) -> bytes:
    f.seek(offset)
    return f.read(length)


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph stores: its initializers and its nodes' tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.HasField("g") else []:
                yield from _tensors(sub)
            for sub in attr.graphs:
                yield from _tensors(sub)
