"""Compatibility shim: the engine directory format moved to plugins/engine_format/ (shared with the runtime).

New code imports `plugins.engine_format`; this module only re-exports it for callers not yet moved.
"""

from __future__ import annotations

from plugins.engine_format.config import CONFIG_NAME, MANIFEST_NAME, SCHEMA_VERSION, EngineConfig
from plugins.engine_format.directory import load_engine_config, looks_like_engine_dir, sha256_file, write_engine_config
from plugins.engine_format.names import PLUGIN_NODES, installed_plugins
from plugins.engine_format.paths import EngineDirError, rank_dir

__all__ = ["CONFIG_NAME", "MANIFEST_NAME", "PLUGIN_NODES", "SCHEMA_VERSION", "EngineConfig", "EngineDirError",
           "installed_plugins", "load_engine_config", "looks_like_engine_dir", "rank_dir", "sha256_file",
           "write_engine_config"]  # fmt: skip
