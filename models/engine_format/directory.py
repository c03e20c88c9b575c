"""The engine directory on disk: writing config.json + manifest.json, and the checks run before anything loads.

`load_engine_config` is what every executor, `mtp-build --check` and the builder (on its temporary
directory) run first: a corrupt, edited or mismatched engine directory is refused with one line naming
the problem and the fix. manifest.json holds the sha256 of every other file, config.json included, so
an edited config is refused like a corrupted graph. Order of checks: docs/ENGINE_FORMAT.md "Checks".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from models.engine_format.config import CONFIG_NAME, MANIFEST_NAME, SCHEMA_VERSION, EngineConfig
from models.engine_format.paths import EngineDirError, rank_dir, safe_path
from plugins.names import installed_plugins

_REBUILD = "rebuild it with `mtp-build --checkpoint CKPT --output {path} --force`"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_engine_config(cfg: EngineConfig) -> Path:
    """Write config.json, then manifest.json with the sha256 of every file under cfg.path (config.json too)."""
    (cfg.path / CONFIG_NAME).write_text(json.dumps(cfg.to_json(), indent=2, sort_keys=True) + "\n")
    files = sorted(
        p for p in cfg.path.rglob("*") if p.is_file() and p.relative_to(cfg.path).as_posix() != MANIFEST_NAME
    )
    cfg.files = {p.relative_to(cfg.path).as_posix(): sha256_file(p) for p in files}
    out = cfg.path / MANIFEST_NAME
    out.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "sha256": cfg.files}, indent=2, sort_keys=True) + "\n")
    return out


def looks_like_engine_dir(path: Path) -> bool:
    """An engine directory of any schema version (what a rebuild may replace): its config.json has the engine
    format's fields, or, when that file is damaged (truncated by a full disk, edited), its manifest.json is one. The
    runtime's advice for a damaged config is a rebuild with --force, which must then be allowed."""
    return _json_has(path / CONFIG_NAME, "schema_version", "graphs") or manifest_files(path) is not None


def manifest_files(path: Path) -> dict | None:
    """manifest.json's file -> sha256 table, or None when it is missing or not a manifest."""
    raw = _json_or_none(path / MANIFEST_NAME)
    files = raw.get("sha256") if raw is not None else None
    return files if isinstance(files, dict) else None


def _json_has(path: Path, *keys: str) -> bool:
    raw = _json_or_none(path)
    return raw is not None and all(k in raw for k in keys)


def _json_or_none(path: Path) -> dict | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise EngineDirError(f"engine directory {path} does not exist; build one with `mtp-build`")
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise EngineDirError(f"{path} is not an engine directory (no {CONFIG_NAME}); build one with `mtp-build`")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{cfg_file} is not valid JSON ({e}); {_REBUILD.format(path=path)}") from e
    if isinstance(raw, dict) and "schema_version" not in raw and ("model_type" in raw or "architectures" in raw):
        # A Hugging Face checkpoint. Never advise `--output` = this directory: a rebuild would replace it.
        raise EngineDirError(
            f"{path} is a model checkpoint, not an engine directory: build an engine from it with `mtp-build "
            f"--checkpoint {path} --output engines/NAME`, or run it directly with `mtp-run --checkpoint {path} "
            "--executor torch`"
        )
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise EngineDirError(f"{cfg_file} has no schema_version: not an engine config; {_REBUILD.format(path=path)}")
    return raw


def _read_manifest(path: Path) -> dict[str, str]:
    """manifest.json's relative path -> sha256, every path checked to stay inside the directory."""
    file = path / MANIFEST_NAME
    try:
        raw = json.loads(file.read_text())
        files = raw["sha256"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise EngineDirError(f"{path} has no readable {MANIFEST_NAME} ({type(e).__name__}: {e}); the directory is "
                             f"incomplete or damaged; {_REBUILD.format(path=path)}") from e  # fmt: skip
    if not isinstance(files, dict) or CONFIG_NAME not in files:
        raise EngineDirError(f"{path}/{MANIFEST_NAME} does not cover {CONFIG_NAME}; {_REBUILD.format(path=path)}")
    for rel in files:
        safe_path(path, rel)
    return files


def _check_file(path: Path, rel: str, digest: str) -> None:
    f = safe_path(path, rel)
    if not f.is_file():
        raise EngineDirError(f"engine file {rel} is missing from {path}; copy the whole engine directory or "
                             f"{_REBUILD.format(path=path)}")  # fmt: skip
    if sha256_file(f) != digest:
        raise EngineDirError(
            f"engine file {rel} in {path} is corrupted (sha256 differs from {MANIFEST_NAME}: modified or damaged "
            f"after the build); {_REBUILD.format(path=path)}"
        )


def _check_plugins(path: Path, recorded: dict[str, Any]) -> None:
    want = installed_plugins()
    if recorded.get("namespace") != want["namespace"]:
        raise EngineDirError(
            f"engine {path} uses plugin namespace {recorded.get('namespace')!r}, this installation provides "
            f"{want['namespace']!r}; {_REBUILD.format(path=path)}"
        )
    # Every plugin the engine was built against must be installed at the same version; plugins added to the
    # installation since (new node kinds an older engine cannot contain) do not make an engine stale.
    recorded_nodes = recorded.get("nodes")
    if not isinstance(recorded_nodes, dict) or not recorded_nodes:
        raise EngineDirError(f"engine {path} records no plugin nodes in config.json; {_REBUILD.format(path=path)}")
    for name, got in recorded_nodes.items():
        version = want["nodes"].get(name)
        if got != version:
            raise EngineDirError(
                f"plugin version mismatch: engine {path} was built with plugin {name} version {got!r}, this "
                f"installation provides version {version!r}; {_REBUILD.format(path=path)} (or install the matching "
                "mtp-engine version)"
            )


def _check_ranks(cfg: EngineConfig) -> None:
    path, world_size = cfg.path, cfg.world_size
    found = sorted(p.name for p in path.glob("rank*") if p.is_dir())
    expected = [rank_dir(r) for r in range(world_size)]
    if found != expected:
        raise EngineDirError(
            f"rank count mismatch: engine {path} has rank directories {found} but config.json says world_size="
            f"{world_size} (expected {expected}); the directory is incomplete or mixed from several builds; "
            f"{_REBUILD.format(path=path)} with --world-size {world_size}"
        )
    if len(cfg.graphs) != world_size:
        raise EngineDirError(f"config.json lists graphs for {len(cfg.graphs)} ranks but world_size={world_size}; "
                             f"{_REBUILD.format(path=path)}")  # fmt: skip


def _check_graph_paths(cfg: EngineConfig, files: dict[str, str]) -> None:
    """Every graph file the config names is inside the directory and covered by the manifest."""
    for rank, per_graph in enumerate(cfg.graphs):
        for graph, kinds in per_graph.items():
            for kind, rel in kinds.items():
                safe_path(cfg.path, rel)
                if rel not in files:
                    raise EngineDirError(f"config.json names {rel} ({rank_dir(rank)}/{graph} {kind}) but "
                                         f"{MANIFEST_NAME} has no checksum for it; {_REBUILD.format(path=cfg.path)}")  # fmt: skip


def load_engine_config(path: str | Path, verify_checksums: bool = True) -> EngineConfig:
    """Parse and check an engine directory (docs/ENGINE_FORMAT.md "Checks"); EngineDirError names what is wrong."""
    path = Path(path)
    raw = _read_json(path)
    if raw["schema_version"] != SCHEMA_VERSION:
        raise EngineDirError(
            f"engine {path} has config schema_version {raw['schema_version']!r}; this installation reads "
            f"schema_version {SCHEMA_VERSION}; {_REBUILD.format(path=path)}"
        )
    files = _read_manifest(path)
    if verify_checksums:  # before any field is trusted: an edited config.json is refused like a corrupted graph
        _check_file(path, CONFIG_NAME, files[CONFIG_NAME])
    try:
        cfg = EngineConfig.from_json(path, raw)
    except (KeyError, TypeError, ValueError) as e:
        raise EngineDirError(f"{path}/{CONFIG_NAME} lacks or mistypes field {e}; {_REBUILD.format(path=path)}") from e
    cfg.files = files
    _check_plugins(path, cfg.plugins)
    _check_ranks(cfg)
    _check_graph_paths(cfg, files)
    if verify_checksums:
        for rel, digest in sorted(files.items()):
            _check_file(path, rel, digest)
    from models.engine_format.crosscheck import check_against_graphs, check_consistent  # torch + onnx: lazy

    check_consistent(cfg)
    check_against_graphs(cfg)
    return cfg
