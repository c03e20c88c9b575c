"""Shared pytest set-up: deterministic, single-threaded torch (2-core machines), and repo-root imports."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True, scope="session")
def _torch_setup():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


TINY = ROOT / "models" / "tiny"
# The flags of the shared multi-rank engines of models/tiny: K=3 so the runtime tests can run K = 0..3.
TINY_TP_BUILD_FLAGS = ("--num-draft-tokens", "3", "--max-seq-len", "128", "--max-batch", "4")


@pytest.fixture(scope="session")
def tiny_dp2tp2_ep4_engine(tmp_path_factory) -> Path:
    """`mtp-build` of models/tiny for 4 ranks, DP2 x TP2 with EP4 (onnxruntime): four ranks' exports take minutes
    on a 2-core machine, so one build serves tests/builder/test_tp_build.py (each rank's graphs vs the torch
    model) and tests/runtime/test_mpi_tp.py (greedy generation under mpirun vs the single rank)."""
    from builder import cli

    out = tmp_path_factory.mktemp("tiny_dp2tp2_ep4") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--world-size", "4", "--tp-size", "2", "--ep-size", "4",
            *TINY_TP_BUILD_FLAGS]  # fmt: skip
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="session")
def tiny_ep2_engine(tmp_path_factory) -> Path:
    """`mtp-build` of models/tiny for 2 ranks with expert parallelism (EP2, no TP; onnxruntime, K=2): one build
    serves tests/builder/test_build.py (each rank's graphs hold its experts) and tests/runtime/test_mpi_lockstep.py
    (mtp-run on it under mpirun)."""
    from builder import cli

    out = tmp_path_factory.mktemp("tiny_ep2") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--world-size", "2", "--ep-size", "2",
            "--num-draft-tokens", "2", "--max-seq-len", "128", "--max-batch", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    return out
