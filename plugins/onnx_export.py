"""ONNX export of the plugin ops: each `torch.ops.mtp.<op>` becomes one node `<Node>` in domain `mtp` (= the TensorRT
plugin namespace), version 1. Schemas and translations are derived from the op specs (plugins/op_spec.py) by
plugins/op_backends.py; the node contract is docs/ENGINE_FORMAT.md "Plugin nodes". The export recipe, in short:

* schemas are registered before export (onnxscript refuses nodes of an unknown domain otherwise);
* translations are plain functions, not `@onnxscript.script` (a scripted function named like the op it
  emits becomes a self-calling function and export fails with a cyclic dependency).

Every node also carries `plugin_namespace="mtp"` and `plugin_version="1"`: from TensorRT 10.15 the parser
only prefers a registered plugin over other resolutions when `plugin_namespace` is present.
"""

from __future__ import annotations

import plugins.collectives  # noqa: F401  (kernels of the ops the graphs contain)
import plugins.gdn_ops  # noqa: F401
import plugins.mla_ops  # noqa: F401
import plugins.ops  # noqa: F401
from plugins.names import DOMAIN, PLUGIN_VERSION
from plugins.op_backends import custom_translation_table, register_onnx_schema
from plugins.op_spec import SPECS

__all__ = ["DOMAIN", "PLUGIN_VERSION", "custom_translation_table", "register_schemas"]


def register_schemas() -> None:
    """Register every spec's node schema with onnx (idempotent)."""
    for spec in SPECS.values():
        register_onnx_schema(spec)
