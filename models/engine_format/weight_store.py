"""One weight store per rank: every compiled package of a rank reads its weights from `rankN/weights.safetensors`.

Each AOTInductor package of a rank (main, mtp_draft, mtp_commit, the fused draft loop) needs some of the same
weights: the embedding and LM head in main and draft, a subset of the draft's in commit, all of the draft's in the
fused loop. Kept inside each package (data/weights/ of the .pt2) they were on disk and in memory once per package
(1.71x the checkpoint on the FP8 test config). So the build (builder/pool_weights.py) moves them into one
safetensors file per rank, each tensor once (its key: dtype + sha256 of its bytes), and leaves in each package its
`weights_config.json` (constant -> weight file, shape, stride, offset: torch's) plus STORE_MAP (weight file -> key).

At load the store is opened once per process (memory-mapped, cached by file identity) and every package of the rank
gets views of the same mapped tensors (`constants`), as torch's load_pt2 would give it its own copies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STORE_NAME = "weights.safetensors"  # in each rank directory, beside the packages
STORE_MAP = "data/weights_store.json"  # in a package: {"store": STORE_NAME, "weights": {weight file: store key}}
WEIGHTS_CONFIG = "weights_config.json"  # torch's, per model in the package: constant -> (file, shape, stride, offset)

# Open stores, by file identity (a rebuilt engine at the same path is another file): the key -> tensor views of
# the mapped file. Kept for the process's lifetime: the packages hold only raw pointers to these constants
# (`user_managed`), and the compiled executor keeps a package's C++ loader, not its Python wrapper.
_OPEN: dict[tuple[str, int, int, int], dict[str, Any]] = {}


def read_store_map(reader: Any) -> dict[str, Any] | None:
    """A package's STORE_MAP (a torch PT2ArchiveReader open on it), or None: its weights are its own."""
    return json.loads(reader.read_string(STORE_MAP)) if STORE_MAP in reader.get_file_names() else None


def open_store(path: Path) -> dict[str, Any]:
    """The store's tensors by key, memory-mapped (safetensors' safe_open: no copy; a page is read when used)."""
    from safetensors import safe_open

    st = path.stat()
    ident = (str(path.resolve()), st.st_ino, st.st_mtime_ns, st.st_size)
    if ident not in _OPEN:
        with safe_open(os.fspath(path), framework="pt") as f:
            _OPEN[ident] = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return _OPEN[ident]


def constants(store: dict[str, Any], store_map: dict[str, Any], weights_config: dict[str, Any]) -> dict[str, Any]:
    """A model's constants as views of the store's tensors, placed exactly as torch's load_pt2 places them."""
    keys = store_map["weights"]
    out = {}
    for name, (file, shape, stride, offset) in weights_config.items():
        whole = store[keys[file]]  # the weight file's whole storage, flat: `offset` counts from its start
        out[name] = whole.as_strided(shape, stride, whole.storage_offset() + offset)
    return out
