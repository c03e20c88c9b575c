"""Helpers that edit a copy of a built engine directory the way a hand edit or a damaged copy would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from models.engine_format import CONFIG_NAME, MANIFEST_NAME
from models.engine_format.directory import sha256_file


def copy_engine(engine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(engine, copy, symlinks=True)
    return copy


def reseal_manifest(engine: Path, **extra: str) -> None:
    """Record the current sha256 of config.json (and of `extra` paths) in manifest.json: what an edit that
    keeps the seal looks like, so the checks behind the checksum are reached."""
    manifest = json.loads((engine / MANIFEST_NAME).read_text())
    manifest["sha256"][CONFIG_NAME] = sha256_file(engine / CONFIG_NAME)
    manifest["sha256"].update(extra)
    (engine / MANIFEST_NAME).write_text(json.dumps(manifest))


def edit_config(path: Path, reseal: bool = True, **changes) -> None:
    """Set config.json fields (`a__b=v` sets raw["a"]["b"]); `reseal` also updates the manifest checksum."""
    raw = json.loads((path / CONFIG_NAME).read_text())
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (path / CONFIG_NAME).write_text(json.dumps(raw))
    if reseal:
        reseal_manifest(path)
