"""The onnxruntime backend: ORT-optimized copies of each graph and the session options the runtime uses.

Owns `SESSION_OPTIONS` (recorded in config.json under build.ort_session_options and applied by
runtime/executors/ort_executor.py) and `optimize_graph`. The optimized copy is written by ORT itself
(SessionOptions.optimized_model_filepath) with the plugin library registered, so it keeps the plugin nodes
(in domain ai.onnx.contrib, which only ORT needs) and its weights go to an external file. The extended level
is used, not "all": layout-specific (NCHWc) rewrites of level 99 tie the saved model to one machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from plugins.ort_ops import make_session_options, prepare_for_ort

SESSION_OPTIONS: dict[str, Any] = {
    "graph_optimization_level": "ORT_ENABLE_EXTENDED",
    "execution_mode": "ORT_SEQUENTIAL",
    "intra_op_num_threads": 0,  # 0 = ORT default (one per core)
    "inter_op_num_threads": 1,
    # The plugin nodes run PyTorch inside ORT's thread; spinning ORT workers would steal the cores those
    # torch kernels need (measured: 60-65 ms vs 7 ms per K=2 step of the tiny engine at batch 4 on 2 cores).
    "allow_spinning": False,
    "providers": ["CPUExecutionProvider"],
    "custom_ops_library": "onnxruntime_extensions",
}


def session_options(recorded: dict[str, Any], model_dir: Path | None = None) -> ort.SessionOptions:
    """SessionOptions from the recorded dict, with the plugin ops' library registered."""
    so = make_session_options()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, recorded["graph_optimization_level"])
    so.execution_mode = getattr(ort.ExecutionMode, recorded["execution_mode"])
    so.intra_op_num_threads = int(recorded["intra_op_num_threads"])
    so.inter_op_num_threads = int(recorded["inter_op_num_threads"])
    if not recorded.get("allow_spinning", False):
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if model_dir is not None:
        # Models are handed to ORT as bytes (after the in-memory plugin-domain rewrite); external weight files
        # are then resolved against this folder.
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_dir))
    return so


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
