"""models/engine_format/: the engine format both the builder and the runtime depend on (neither imports the other).

* `names`       plugin node names, their ONNX domain and versions (`installed_plugins`), incl. the TP collective nodes
* `layout`      `KVLayout` (pool geometry + block-table width) and `table_width`, the one width function
* `graph_io`    the graph I/O specs (names, dtypes, dims) and `feeds`, which builds an executor's feed dict
* `mapping`     `RankMapping`: a rank's TP / DP / EP place derived from `Parallel`, and the mapping rules
* `config`      `EngineConfig` (typed config.json) with `Limits`, `Parallel` and a JSON round trip
* `paths`       `safe_path`: engine paths must stay inside the engine directory; `EngineDirError`
* `directory`   writing config.json + manifest.json (sha256 of every file, config included), `load_engine_config`
* `crosscheck`  config vs itself and vs the ONNX graphs (plugin attributes, I/O dtypes and dims)
* `ort_session` recorded ONNX Runtime session options (imports onnxruntime: import it explicitly)

Documented in docs/ENGINE_FORMAT.md. The names below are re-exported for convenience.
"""

from models.engine_format.config import CONFIG_NAME, MANIFEST_NAME, SCHEMA_VERSION, EngineConfig, Limits, Parallel
from models.engine_format.directory import (
    load_engine_config,
    looks_like_engine_dir,
    manifest_files,
    write_engine_config,
)
from models.engine_format.layout import KVLayout, StateLayout, table_width
from models.engine_format.paths import EngineDirError, rank_dir, safe_path

__all__ = [
    "CONFIG_NAME", "MANIFEST_NAME", "SCHEMA_VERSION", "EngineConfig", "EngineDirError", "KVLayout", "Limits",
    "StateLayout", "Parallel", "load_engine_config", "looks_like_engine_dir", "manifest_files", "rank_dir", "safe_path", "table_width",
    "write_engine_config",
]  # fmt: skip
