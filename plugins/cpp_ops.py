"""Loads the C++ CPU kernels of the plugin ops (plugins/csrc/) into torch, once.

The package build compiles them (CMakeLists.txt, run by scikit-build-core: `make install`, `pip install`, wheels)
into lib/libmtp_ops.so beside this file: in place in a source tree (the editable install `make install` does),
inside the installed package otherwise, so this one path serves both.

The library defines every `mtp::` plugin op's schema and registers its CPU kernel with the dispatcher, so
eager torch, torch.compile, AOTInductor and the ONNX Runtime ops (which call the torch ops) all run the same
C++ code. Python adds the fake implementations, the CUDA (Triton) implementations and the MPI exchange of
expert/tensor-parallel MoE (plugins/ops.py, plugins/mla_ops.py, plugins/moe_ep.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parent / "lib" / "libmtp_ops.so"  # built by the package build; shipped in wheels
_loaded = False


def load() -> None:
    """Load the library into this process (idempotent); a one-line error if it was never built.

    Only a source tree can lack it (a wheel always has it: its build fails without it), and there `make install`
    builds it (or `pip install --no-build-isolation -e .`, which is what `make install` runs)."""
    global _loaded
    if _loaded:
        return
    if not LIBRARY.is_file():
        raise ImportError("mtp: the C++ plugin library is not built; run `make install`")
    torch.ops.load_library(str(LIBRARY))
    _loaded = True


def cpu_isa(choose: str = "") -> str:
    """The instruction set the C++ kernels use ("avx512", "avx2" or "generic"); choose "generic" / "avx2" /
    "avx512" / "best" to switch (the portable and AVX2 paths stay testable on an AVX-512 machine)."""
    load()
    return torch.ops.mtp.cpu_isa(choose)


def amx_min_rows(set_to: int = -1) -> int:
    """The row count from which mtp::linear_bf16 takes the exact AMX path (plugins/csrc/amx_bf16.h) on the AVX-512
    ISA; set_to >= 1 sets it (1: always, 1 << 30: never; tests and benches). 0: this CPU or OS cannot run AMX."""
    load()
    return int(torch.ops.mtp.amx_min_rows(set_to))


def gdn_chunk_min_run(set_to: int = -1) -> int:
    """The shortest run of prompt rows (rows storing no state) that `mtp::gdn_step` runs in the chunked form
    (plugins/csrc/gdn_chunk.h); set_to >= 1 sets it (1 << 30: row by row everywhere; tests and the prefill bench)."""
    load()
    return int(torch.ops.mtp.gdn_chunk_min_run(set_to))


load()
