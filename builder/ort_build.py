"""The onnxruntime backend: ORT-optimized copies of each graph, made with the session options the runtime uses.

Owns `optimize_graph`. The session options (`SESSION_OPTIONS`, recorded in config.json under
build.ort_session_options and applied by runtime/executors/ort_executor.py) are engine format:
models/engine_format/ort_session.py. The optimized copy is written by ORT itself
(SessionOptions.optimized_model_filepath) with the plugin library registered, so it keeps the plugin nodes
(in domain ai.onnx.contrib, which only ORT needs) and its weights go to an external file.
"""

from __future__ import annotations

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
    return out, "saved by ORT with the plugin library registered (plugin nodes in domain ai.onnx.contrib)"
