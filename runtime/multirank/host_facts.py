"""What each host adds to the start-up agreement: the installation and CPU facts ranks on two hosts can differ in.

Ranks on one host share one installation; ranks on two hosts each bring their own, and a difference there runs
mismatched code in lockstep (another torch, another build of our kernels) or picks another executor (a CPU
without the ISA an engine's compiled packages were built for falls back to ONNX Runtime). These keys join the
settings fingerprint (runtime/multirank/fingerprint.py), so such a job ends at start-up with one line naming both
hosts and the difference, before any step's collective. Engine files are checked by each rank at load against
the manifest's checksums (models/engine_format), which fails that rank alone with one line naming its host.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import socket
from pathlib import Path
from typing import Any

# The distributions whose version changes what a rank computes or how it talks to its peers.
PACKAGES = ("torch", "numpy", "onnxruntime", "mpi4py", "safetensors", "tokenizers")


def hostname() -> str:
    return socket.gethostname()


def spans_hosts() -> bool:
    """True when Open MPI placed this job's ranks on more than one host (fewer local ranks than ranks)."""
    local, world = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE"), os.environ.get("OMPI_COMM_WORLD_SIZE")
    return bool(local and world and int(local) < int(world))


def rank_tag(rank: int) -> str:
    """How a rank names itself in its one-line errors: `rank 1`, or `rank 1 on HOST` when the job spans hosts."""
    return f"rank {rank} on {hostname()}" if spans_hosts() else f"rank {rank}"


def host_facts(compiled_packages: bool) -> dict[str, Any]:
    """host.packages.<name> versions, host.plugin_library (sha256 of our compiled kernels), and host.cpu_isa when
    the engine has compiled packages (native code for one ISA, which every host must then have)."""
    facts: dict[str, Any] = {}
    for name in PACKAGES:
        try:
            facts[f"host.packages.{name}"] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[f"host.packages.{name}"] = None
    facts["host.plugin_library"] = _plugin_library_digest()
    if compiled_packages:
        from models.engine_format.compiled import host_isa

        facts["host.cpu_isa"] = host_isa()
    return facts


def _plugin_library_digest() -> str | None:
    from plugins.cpp_ops import LIBRARY  # the C++ kernels this installation loads

    if not Path(LIBRARY).is_file():
        return None
    return hashlib.sha256(Path(LIBRARY).read_bytes()).hexdigest()[:16]


# What to do about a difference, by key prefix (fingerprint.first_difference's advice).
ADVICE = {
    "host.packages.": "install the same versions on every host",
    "host.plugin_library": "build the same mtp-engine version on every host (`make install`)",
    "host.cpu_isa": "the engine's compiled packages are native code for one CPU ISA: run every rank on hosts "
                    "with it (or build the engine with `--compile none` for mixed hosts)",
}
