"""The engine directory on disk: config.json schema, checksums, and the checks run before anything loads.

Owns `SCHEMA_VERSION`, `EngineConfig` (the parsed config.json), `write_config` and `load_engine_config`.
The runtime calls `load_engine_config` before it creates a session or allocates a pool: a corrupt or
mismatched engine directory is refused with a message naming the problem and the fix (design section 11).
The layout and every field are documented in docs/ENGINE_FORMAT.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from models.config import ModelConfig
from plugins.onnx_export import DOMAIN, PLUGIN_VERSION, VERSION

SCHEMA_VERSION = 1
CONFIG_NAME = "config.json"
PLUGIN_NODES = ("KvWrite", "PagedAttention", "MoeExperts")


class EngineDirError(ValueError):
    """An engine directory that must not be loaded; the message names the problem and the fix."""


def installed_plugins() -> dict[str, Any]:
    """Plugin names and versions this installation executes (what an engine must have been built with)."""
    return {"namespace": DOMAIN, "onnx_opset": VERSION, "nodes": {name: PLUGIN_VERSION for name in PLUGIN_NODES}}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rank_dir(rank: int) -> str:
    return f"rank{rank}"


@dataclass
class EngineConfig:
    """config.json, parsed. Paths in `graphs` and `files` are relative to `path`."""

    path: Path
    schema_version: int
    model: ModelConfig
    dtype: str
    limits: dict[str, int]  # max_batch, max_num_tokens, max_seq_len
    kv: dict[str, int]  # block_size, num_planes, num_kv_heads, head_dim, max_blocks_per_seq, default_num_blocks
    num_draft_tokens: int
    parallel: dict[str, int]  # world_size, ep_size, tp_size
    plugins: dict[str, Any]
    backend: str
    build: dict[str, Any]
    checkpoint: dict[str, str]
    tokenizer_files: list[str]
    graphs: list[dict[str, dict[str, str]]]  # per rank: graph name -> {"onnx": ..., "ort_optimized": ..., "plan": ...}
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256

    @property
    def world_size(self) -> int:
        return self.parallel["world_size"]

    def graph_file(self, rank: int, graph: str, kind: str = "onnx") -> Path | None:
        rel = self.graphs[rank].get(graph, {}).get(kind)
        return self.path / rel if rel else None

    def to_json(self) -> dict[str, Any]:
        """Every field but `path` (the directory itself), with the model config as a plain dict."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "path"}
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_json(cls, path: Path, raw: dict[str, Any]) -> EngineConfig:
        """Inverse of `to_json`; KeyError names a missing field."""
        names = [f.name for f in fields(cls) if f.name != "path"]
        return cls(path=path, **{**{n: raw[n] for n in names}, "model": ModelConfig.from_dict(raw["model"])})


def write_config(cfg: EngineConfig) -> Path:
    """Checksum every file under cfg.path (except config.json itself) into cfg.files, then write config.json."""
    files = sorted(p for p in cfg.path.rglob("*") if p.is_file() and p.name != CONFIG_NAME)
    cfg.files = {str(p.relative_to(cfg.path)): sha256_file(p) for p in files}
    out = cfg.path / CONFIG_NAME
    out.write_text(json.dumps(cfg.to_json(), indent=2, sort_keys=True) + "\n")
    return out


def looks_like_engine_dir(path: Path) -> bool:
    """An engine directory of any schema version (what a rebuild may replace without --force)."""
    try:
        raw = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and "schema_version" in raw and "graphs" in raw


_REBUILD = "rebuild it with `mtp-build --checkpoint CKPT --output {path} --force`"


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
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise EngineDirError(f"{cfg_file} has no schema_version: not an engine config; {_REBUILD.format(path=path)}")
    return raw


def _check_plugins(path: Path, recorded: dict[str, Any]) -> None:
    want = installed_plugins()
    if recorded.get("namespace") != want["namespace"]:
        raise EngineDirError(
            f"engine {path} uses plugin namespace {recorded.get('namespace')!r}, this installation provides "
            f"{want['namespace']!r}; {_REBUILD.format(path=path)}"
        )
    for name, version in want["nodes"].items():
        got = recorded.get("nodes", {}).get(name)
        if got != version:
            raise EngineDirError(
                f"plugin version mismatch: engine {path} was built with plugin {name} version {got!r}, this "
                f"installation provides version {version!r}; {_REBUILD.format(path=path)} (or install the matching "
                "mtp-engine version)"
            )


def _check_ranks(path: Path, world_size: int) -> None:
    found = sorted(p.name for p in path.glob("rank*") if p.is_dir())
    expected = [rank_dir(r) for r in range(world_size)]
    if found != expected:
        raise EngineDirError(
            f"rank count mismatch: engine {path} has rank directories {found} but config.json says world_size="
            f"{world_size} (expected {expected}); the directory is incomplete or mixed from several builds; "
            f"{_REBUILD.format(path=path)} with --world-size {world_size}"
        )


def _check_files(path: Path, files: dict[str, str]) -> None:
    if not files:
        raise EngineDirError(f"{path}/{CONFIG_NAME} lists no files; {_REBUILD.format(path=path)}")
    for rel, digest in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            raise EngineDirError(f"engine file {rel} is missing from {path}; copy the whole engine directory or "
                                 f"{_REBUILD.format(path=path)}")  # fmt: skip
        if sha256_file(f) != digest:
            raise EngineDirError(
                f"engine file {rel} in {path} is corrupted (sha256 differs from config.json: modified or damaged "
                f"after the build); {_REBUILD.format(path=path)}"
            )


def load_engine_config(path: str | Path, verify_checksums: bool = True) -> EngineConfig:
    """Parse and check an engine directory: schema version, plugin versions, rank count, files + sha256."""
    path = Path(path)
    raw = _read_json(path)
    if raw["schema_version"] != SCHEMA_VERSION:
        raise EngineDirError(
            f"engine {path} has config schema_version {raw['schema_version']!r}; this installation reads "
            f"schema_version {SCHEMA_VERSION}; {_REBUILD.format(path=path)}"
        )
    try:
        cfg = EngineConfig.from_json(path, raw)
    except (KeyError, TypeError) as e:
        raise EngineDirError(f"{path}/{CONFIG_NAME} lacks or mistypes field {e}; {_REBUILD.format(path=path)}") from e
    _check_plugins(path, cfg.plugins)
    _check_ranks(path, cfg.world_size)
    if len(cfg.graphs) != cfg.world_size:
        raise EngineDirError(f"config.json lists graphs for {len(cfg.graphs)} ranks but world_size={cfg.world_size}; "
                             f"{_REBUILD.format(path=path)}")  # fmt: skip
    if verify_checksums:
        _check_files(path, cfg.files)
    return cfg
