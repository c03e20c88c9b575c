"""Move a rank's package weights into the rank's one weight store (models/engine_format/weight_store.py says why).

After a rank's packages are written (builder/compile_aoti.py: each keeps its weights as pickled tensors under
data/weights/), every weight file of every package is read, keyed by dtype + sha256 of its bytes and written once
into `weights.safetensors`; each package is rewritten without its data/weights/ entries, with STORE_MAP naming each
of its weight files' key (its weights_config.json stays: the shapes, strides and offsets). The store is an ordinary
file of the rank directory: config.json's manifest lists it with its sha256 like every other file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from models.engine_format.weight_store import STORE_MAP, STORE_NAME

# Records the archive writer adds itself (torch's PyTorchFileWriter): copying them would write them twice.
_WRITER_RECORDS = frozenset({".data/version", ".data/serialization_id", "byteorder"})


def pool_rank_weights(rdir: Path, packages: list[Path]) -> dict[str, Any]:
    """Pool `packages`' weights (all in `rdir`) into rdir/STORE_NAME; returns the bytes the packages held and the
    bytes the store holds (for config.json's compile record). A package without data/weights/ (none to move) is
    left as it is."""
    # torch's archive module imports Inductor (and triton where installed): only when a build pools weights
    from torch.export.pt2_archive._package import WEIGHTS_DIR, PT2ArchiveReader

    store: dict[str, torch.Tensor] = {}
    held = 0
    for path in packages:
        with PT2ArchiveReader(str(path)) as reader:
            names = reader.get_file_names()
            keys: dict[str, str] = {}
            for name in (n for n in names if n.startswith(WEIGHTS_DIR)):
                flat = _whole_storage(torch.load(io.BytesIO(reader.read_bytes(name)), weights_only=True))
                key = f"{str(flat.dtype).removeprefix('torch.')}-{_digest(flat)}"
                store.setdefault(key, flat)
                keys[name[len(WEIGHTS_DIR) :]] = key
                held += flat.numel() * flat.element_size()
            if not keys:
                continue
            kept = {n: reader.read_bytes(n) for n in set(names) - _WRITER_RECORDS if not n.startswith(WEIGHTS_DIR)}
        _rewrite(path, kept, {"store": STORE_NAME, "weights": keys})
    if store:
        save_file(store, str(rdir / STORE_NAME))
        os.chmod(rdir / STORE_NAME, 0o644)  # as the engine's other files (safetensors writes it owner-only)
    return {"package_weight_bytes": held, "store_bytes": sum(t.numel() * t.element_size() for t in store.values())}


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as one flat tensor of its dtype: weights_config.json's offsets count from its
    start (torch saved the storage whole)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))


def _digest(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _rewrite(path: Path, records: dict[str, bytes], store_map: dict[str, Any]) -> None:
    """The package at `path` holding `records` plus STORE_MAP, replaced in one rename (the archive's root folder is
    named after the file, so it is written under the same name in a private folder first)."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter  # lazily, as in pool_rank_weights

    with tempfile.TemporaryDirectory(prefix=".pool_", dir=path.parent) as tmp:
        new = Path(tmp) / path.name
        with PT2ArchiveWriter(str(new)) as writer:
            for name, data in records.items():
                writer.write_bytes(name, data)
            writer.write_string(STORE_MAP, json.dumps(store_map))
        os.replace(new, path)
