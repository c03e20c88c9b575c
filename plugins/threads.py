"""How many CPU threads a process uses (torch, our kernels' OpenMP, ONNX Runtime's intra-op pool): one rule for
every CLI's `--threads` (mtp-build, mtp-run, mtp-serve both frontends, mtp-bench)."""

from __future__ import annotations

import os


def default_threads() -> int:
    """OMP_NUM_THREADS when the environment sets it, else the cores this process may run on (its affinity mask: a
    container's or `taskset`'s limit, not the machine's count). Workers wait passively (runtime/__init__.py), so
    threads a step cannot use cost nothing while idle."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_threads(n: int) -> None:
    """torch's (and so our kernels') thread count; ONNX Runtime takes it per session from its callers."""
    import torch

    torch.set_num_threads(n)
