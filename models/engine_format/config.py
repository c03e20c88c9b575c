"""config.json, typed: `EngineConfig` and its parts, with an exact JSON round trip.

Field meanings are documented in docs/ENGINE_FORMAT.md ("config.json"). The checks that decide whether
a directory may be loaded are in directory.py; this module only parses (strictly: a missing, unknown or
mistyped field raises KeyError/TypeError naming it, which the loader turns into a one-line refusal).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from models.config import ModelConfig
from models.engine_format.layout import KVLayout, StateLayout
from models.engine_format.paths import safe_path
from plugins.mapping import Parallel

SCHEMA_VERSION = 3  # 2: typed kv layout (table_width incl. lookahead), manifest.json covering config.json; 3: DSA engines
# (the indexer-key planes counted in kv.num_planes, DsaIndexTopk / DsaSparseAttention nodes: a schema-2 reader must refuse them)
CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True, slots=True)
class Limits:
    """The largest step the graphs (and TensorRT profiles) were built for."""

    max_batch: int  # requests per step
    max_num_tokens: int  # packed main rows per step, >= max_batch * (1 + K)
    max_seq_len: int  # positions per request


T = TypeVar("T")


def _ints(cls: type[T], raw: Any, where: str) -> T:
    """An all-int dataclass from a JSON object with exactly its fields."""
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is not an object")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    # A field with a default (kv.kv_kind) may be absent: configs written before it existed mean the default.
    optional = {f.name for f in fields(cls) if f.default is not MISSING}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise KeyError(f"{where}.{unknown[0]} (unknown field)")
    names = [n for n in names if n in raw or n not in optional]
    for n in names:
        if n not in raw:
            raise KeyError(f"{where}.{n}")
        if type(raw[n]) is not int:
            raise TypeError(f"{where}.{n}={raw[n]!r} is not an int")
    return cls(**{n: raw[n] for n in names})


@dataclass
class EngineConfig:
    """config.json, parsed. Paths in `graphs` are relative to `path` (resolve them with `graph_file`)."""

    path: Path
    schema_version: int
    model: ModelConfig
    dtype: str
    limits: Limits
    kv: KVLayout
    num_draft_tokens: int
    parallel: Parallel
    plugins: dict[str, Any]
    backend: str
    build: dict[str, Any]
    checkpoint: dict[str, str]
    tokenizer_files: list[str]
    # per rank: graph name -> {"onnx", "data"?, "ort_optimized"?, "plan"?, "aoti"?}; no "data": a compiled engine built
    # without --keep-onnx, whose ONNX graphs carry no weights (`onnx_weights`)
    graphs: list[dict[str, dict[str, str]]]
    # relative path -> sha256 of every file but manifest.json (config.json included); read from manifest.json
    files: dict[str, str] = field(default_factory=dict)
    # The Gated DeltaNet state pool of a hybrid model; None (absent from config.json) for every other model.
    state: StateLayout | None = None

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def onnx_weights(self) -> bool:
        """Whether the ONNX graphs carry their weights, i.e. ONNX Runtime can run them (docs/ENGINE_FORMAT.md)."""
        return all("data" in kinds for per_graph in self.graphs for kinds in per_graph.values())

    def graph_file(self, rank: int, graph: str, kind: str = "onnx") -> Path | None:
        """The file, checked to stay inside the engine directory; None when the engine has none of that kind."""
        rel = self.graphs[rank].get(graph, {}).get(kind)
        return safe_path(self.path, rel) if rel else None

    def to_json(self) -> dict[str, Any]:
        """Every field but `path` (the directory) and `files` (manifest.json's), typed parts as plain dicts."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("path", "files", "state")}
        out["model"] = self.model.to_dict()
        out["limits"], out["kv"], out["parallel"] = asdict(self.limits), asdict(self.kv), asdict(self.parallel)
        if self.state is not None:
            out["state"] = asdict(self.state)
        return out

    @classmethod
    def from_json(cls, path: Path, raw: dict[str, Any]) -> EngineConfig:
        """Inverse of `to_json`; KeyError/TypeError name a missing or mistyped field."""
        names = [f.name for f in fields(cls) if f.name not in ("path", "files", "state")]
        missing = [n for n in names if n not in raw]
        if missing:
            raise KeyError(missing[0])
        typed = {
            "model": ModelConfig.from_dict(raw["model"]),
            "limits": _ints(Limits, raw["limits"], "limits"),
            "kv": _ints(KVLayout, raw["kv"], "kv"),
            "parallel": _ints(Parallel, raw["parallel"], "parallel"),
            "state": None if raw.get("state") is None else _ints(StateLayout, raw["state"], "state"),
        }
        for n in ("schema_version", "num_draft_tokens"):
            if type(raw[n]) is not int:
                raise TypeError(f"{n}={raw[n]!r} is not an int")
        return cls(path=path, **{**{n: raw[n] for n in names}, **typed})
