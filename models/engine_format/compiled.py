"""The compiled CPU artifacts of an engine (AOTInductor packages): their config.json record and load checks.

`mtp-build --compile aoti` adds, per rank and graph, a `.pt2` package next to the ONNX files (graph kind
`aoti` in `graphs`) and records `build.compiled`: the Inductor settings, the torch version and the CPU's
vector ISA it was compiled for. A package is native code for one torch build and one ISA: `compiled_problem`
says why this installation cannot run it (the runtime then refuses with one line, or `auto` falls back to
ONNX Runtime). The ONNX graphs stay in the directory either way (the interchange for TensorRT).
"""

from __future__ import annotations

from typing import Any

from models.engine_format.config import EngineConfig

AOTI_KIND = "aoti"  # graph kind in config.json's `graphs`, and the package name suffix (main.aoti.pt2)
# `build.compiled.fp8` of an engine whose packages store FP8 release weights as released (absent otherwise): this
# format, plus `ops`, the mtp ops those packages call for it, which the installation that runs them must have.
FP8_FORMAT: dict[str, Any] = {"fmt": "e4m3", "weight_block_size": [128, 128]}
# `build.compiled.int8` of an engine built with `mtp-build --quantize int8`: this format, `ops` as for fp8, and
# `weights`, the checkpoint names of the weights stored int8 (`mtp-build --check` quantizes the same ones).
INT8_FORMAT: dict[str, Any] = {"fmt": "int8", "scheme": "symmetric per output channel, fp32 scale = max|w| / 127"}


def host_isa() -> str:
    """The vector ISA Inductor picks on this CPU (e.g. "avx512"), which compiled packages are built for."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # torch only when asked (see compiled_problem)

    return str(pick_vec_isa()) or "none"


def compiled_info(cfg: EngineConfig) -> dict[str, Any] | None:
    """`build.compiled` when every graph of every rank has a package, else None (an engine built without it)."""
    info = cfg.build.get("compiled")
    if not isinstance(info, dict):
        return None
    if not all(AOTI_KIND in kinds for per_graph in cfg.graphs for kinds in per_graph.values()):
        return None
    return info


def compiled_problem(cfg: EngineConfig) -> str | None:
    """Why this installation cannot run the engine's compiled packages, or None when it can."""
    import torch  # here: the control plane (runtime.factory) imports this module without torch

    info = compiled_info(cfg)
    if info is None:
        return f"engine {cfg.path} has no compiled packages (build it with `mtp-build --compile aoti`)"
    if info.get("torch_version") != torch.__version__:
        return (f"engine {cfg.path}'s compiled packages were built with torch {info.get('torch_version')}, this "
                f"installation has {torch.__version__}; rebuild with `mtp-build --compile aoti --force`")
    if info.get("isa") != host_isa():
        return (f"engine {cfg.path}'s compiled packages were built for CPU ISA {info.get('isa')!r}, this CPU has "
                f"{host_isa()!r}; rebuild on this machine with `mtp-build --compile aoti --force`")
    for key, what in (("fp8", "FP8"), ("int8", "int8")):
        fmt = info.get(key)
        if fmt is None:
            continue
        import plugins.cpp_ops  # noqa: F401  (the mtp ops of this installation)

        ops = fmt.get("ops") if isinstance(fmt, dict) else None
        missing = [op for op in ops or [] if not hasattr(torch.ops.mtp, str(op))] if isinstance(ops, list) else ["?"]
        if missing:
            return (f"engine {cfg.path}'s compiled packages keep {what} weights and call mtp::{missing[0]}, which this "
                    "installation does not have; install the mtp-engine version that built it, or rebuild with "
                    "`mtp-build --compile aoti --force`")
    return None
