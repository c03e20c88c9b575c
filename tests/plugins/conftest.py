"""Shared by the C++ kernel tests: what this CPU has, and `isa`, a fixture that runs a test on one instruction set
of the kernels (indirect parametrization) and restores the run-time choice after it."""

from __future__ import annotations

from pathlib import Path

import pytest

_FLAGS = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
# the same feature sets plugins/csrc/common.cpp requires before it picks a path
HAS_AVX512 = all(f in _FLAGS for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2", "bmi2"))
HAS_AVX2 = all(f in _FLAGS for f in ("avx2", "fma", "f16c", "bmi2"))


@pytest.fixture
def isa(request):
    import plugins.cpp_ops as cpp_ops

    before = cpp_ops.cpu_isa()
    cpp_ops.cpu_isa(request.param)
    yield request.param
    cpp_ops.cpu_isa(before)
