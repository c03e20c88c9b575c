"""ONNX Runtime session options of an engine: recorded by the builder, applied by the ORT executor.

`SESSION_OPTIONS` is what the onnxruntime backend records in config.json (build.ort_session_options);
`session_options(recorded)` turns a recorded dict back into `ort.SessionOptions` with the plugin ops'
library registered. The extended level is used, not "all": layout-specific (NCHWc) rewrites of level 99
tie a saved optimized model to one machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort

from plugins.ort_ops import make_session_options

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
