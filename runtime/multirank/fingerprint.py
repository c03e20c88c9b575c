"""The settings every rank of a lockstep (mpirun) job must share, and the first field where two ranks differ.

Ranks exchange tokens inside every MoE layer, so they must issue the same collectives in the same order:
same model layers, same draft depth k, same limits, same executor, same rank mapping (tp/ep/world size). A rank launched with other settings
(say another --num-draft-tokens) would otherwise block forever in a mismatched collective. This module is
pure: `settings_fingerprint` flattens the engine's dataclasses into a dict of dotted keys, and
`first_difference` compares the gathered dicts; runtime/multirank/parallel.py does the allgather.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Build metadata (output path, versions of the build tools) may differ between two copies of one engine
# without changing what the ranks execute; the graph files' sha256 (engine.files) do cover the graphs.
_SKIPPED_ENGINE_KEYS = ("build",)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            _flatten(f"{prefix}.{k}", value[k], out)
    elif isinstance(value, list | tuple):
        out[prefix] = [repr(v) for v in value]  # repr: comparable and picklable whatever the element type
    else:
        out[prefix] = value if isinstance(value, int | float | str | bool | None) else repr(value)


def settings_fingerprint(executor, model_cfg, runtime_cfg, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Dotted keys -> plain values: model.*, runtime.*, executor, engine.* (engine-directory executors), plus
    `extra` (the launch-wide settings: the rank mapping parallel.*, the collective timeout)."""
    out: dict[str, Any] = {"executor": type(executor).__name__, **(extra or {})}
    _flatten("model", model_cfg, out)
    _flatten("runtime", runtime_cfg, out)
    engine_cfg = getattr(executor, "config", None)  # the EngineConfig of onnxruntime / tensorrt
    if engine_cfg is not None and hasattr(engine_cfg, "to_json"):
        _flatten("engine", {k: v for k, v in engine_cfg.to_json().items() if k not in _SKIPPED_ENGINE_KEYS}, out)
    return out


def first_difference(fingerprints: list[dict[str, Any]], hosts: list[str] | None = None) -> str | None:
    """One line naming the first key (sorted) where some rank differs from rank 0, or None when all agree. With
    `hosts` (each rank's hostname) spanning more than one host, the line names the two ranks' hosts too."""
    ref = fingerprints[0]
    named = hosts if hosts is not None and len(set(hosts)) > 1 else None
    # host.* first: a host's installation or CPU explains the differences that follow from it (another executor)
    for key in sorted(set().union(*fingerprints), key=lambda k: (not k.startswith("host."), k)):
        for rank, fp in enumerate(fingerprints[1:], start=1):
            a, b = ref.get(key, "<missing>"), fp.get(key, "<missing>")
            if a != b:
                at = (lambda r: f"rank {r} ({named[r]})") if named else (lambda r: f"rank {r}")
                return f"ranks disagree on {key}: {at(0)} has {_short(a)}, {at(rank)} has {_short(b)}; {_advice(key)}"
    return None


def _advice(key: str) -> str:
    from runtime.multirank.host_facts import ADVICE

    return next((v for k, v in ADVICE.items() if key.startswith(k)), "launch every rank with the same engine and flags")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
