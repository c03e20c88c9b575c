"""MoE experts: the torch op (ep_size 1) vs moe_experts_ref, and the expert-parallel exchange under real MPI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401
from plugins.reference import moe_experts_ref

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 6),
    num_experts=st.sampled_from([1, 3, 4]),
    top_k=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_moe_op_matches_reference(tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 6, 4
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)  # repeats allowed: each slot counts
    weights = torch.rand(tokens, top_k, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen).to(dtype)
    w_down = torch.randn(num_experts, hidden, inter, generator=gen).to(dtype)
    out = torch.ops.mtp.moe_experts(x, ids, weights, w_gate_up, w_down, num_experts, 1)
    ref = moe_experts_ref(x, ids, weights, w_gate_up, w_down)
    assert out.dtype == dtype and out.shape == x.shape
    atol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=1e-2)


def _mpirun() -> str | None:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


@pytest.mark.mpi
@pytest.mark.skipif(_mpirun() is None, reason="mpirun not found")
def test_moe_expert_parallel_under_mpirun() -> None:
    """2 ranks, experts split 4+4; cases: both ranks with tokens, rank 1 with 0 tokens, bf16 activations; with fp32
    activations also the int8, int4 and FP8 experts (each rank its shard in the stored format)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    mpirun = _mpirun()
    assert mpirun is not None
    cmd = [mpirun, "-np", "2", "--oversubscribe", sys.executable, "-m", "tests.plugins.mpi_moe_worker"]
    # Own process group: on timeout kill mpirun *and* its ranks, so a hang can never outlive the test.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpirun timed out:\n{output}")
    assert proc.returncode == 0, output
    assert "MOE_EP_RESULT failures=0 ranks=2" in output, output
