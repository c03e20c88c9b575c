"""Tensor parallelism under a real `mpirun --oversubscribe`: the TP leader runs the engine, its followers replay
every executor call (runtime/tp_group.py); outputs equal the single-rank run; a killed, stalled or differently
configured rank ends every rank with one line. Every launch has a timeout, so a hang fails the test.

Mappings (tests/runtime/mpi_tp_worker.py, the tiny 4-expert checkpoint, weights replicated over the TP group,
torch executor): TP2 (= TP2 with EP2: with 2 ranks the contract puts the routed experts on both), DP2 x TP2
with EP4 (4 ranks: two schedules in DP lockstep over the leaders comm, experts exchanged over all ranks),
and EP4 without TP; each runs K = 0, 1 and 3 with chunked prefill (8-token chunks), a prefix hit and late
arrivals that mix prefill and decode in one batch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.testing import make_checkpoint, tiny_config
from runtime.factory import create_engine
from runtime.sampling import SamplingParams
from tests.runtime.mpi_tp_worker import SETTINGS, prompts
from tests.runtime.test_mpi_lockstep import ENV, MPIRUN, ROOT, _alive, our_lines, pytestmark  # noqa: F401

WORKER = ROOT / "tests/runtime/mpi_tp_worker.py"
PROG = "mpi_tp_worker"


def launch(np_: int, *args, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", sys.executable, str(WORKER), *map(str, args)]
    return subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_ckpt")
    make_checkpoint(path, tiny_config(n_routed_experts=4, n_group=2, topk_group=1), seed=11)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Single rank, K=0, no chunking: the greedy output ids of every prompt (lossless: any K, chunk, batch)."""
    engine = create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=0,
                           **{**SETTINGS, "max_prefill_chunk": 64})  # fmt: skip
    first, late = prompts()
    outs = engine.generate(first + late, SamplingParams(max_tokens=12))
    ids = [f"a{i}" for i in range(len(first))] + [f"b{i}" for i in range(len(late))]
    return {i: o.output_ids for i, o in zip(ids, outs, strict=True)}


@pytest.mark.parametrize("np_,tp,ep", [(2, 2, 2), (4, 2, 4), (4, 2, 2), (4, 1, 4)],
                         ids=["TP2-EP2", "DP2xTP2-EP4", "DP2xTP2-EP2", "EP4"])  # fmt: skip
def test_tp_outputs_equal_single_rank(checkpoint, reference, tmp_path, np_, tp, ep):
    out = tmp_path / "out.json"
    proc = launch(np_, checkpoint, out, "ok", tp, ep, "0,1,3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for k, res in results.items():
        assert res["outputs"] == reference, f"K={k}"
        calls = res["calls"]  # every follower ran exactly its leader's executor calls
        assert all(calls[r] == calls[r - r % tp] for r in range(np_)), (k, calls)
        assert min(calls) > 0
        assert res["heads"] == [tiny_config().num_attention_heads // tp] * np_  # really sharded


def test_idle_leader_does_not_trip_the_watchdog(checkpoint, tmp_path):
    """The leader idles 2.5 x the timeout between two steps (a server without requests): followers wait
    unarmed, so the job completes."""
    out = tmp_path / "out.json"
    proc = launch(2, checkpoint, out, "idle", 2, 2, "1", env={"MTP_TEST_COLLECTIVE_TIMEOUT": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(out.read_text())["1"]["outputs"]) == 6


WATCHDOG_LINE = re.compile(r"^mpi_tp_worker: error: \[rank (\d)\] step 3: (.+) did not complete within 3 s "
                           r"\(another rank stalled or died\); exiting$")  # fmt: skip


@pytest.mark.parametrize("np_,tp,ep,stalled", [(2, 2, 2, 1), (4, 2, 4, 2)], ids=["TP2-follower", "DP2xTP2-leader"])
def test_forced_stall_becomes_the_watchdogs_error(checkpoint, tmp_path, np_, tp, ep, stalled):
    """MTP_FAULT_STALL makes one rank sleep 60 s inside its step-3 main forward; with --collective-timeout 3 the
    ranks waiting on it (and the stalled rank itself, armed around its forward) print the watchdog's line
    and the job ends non-zero within timeout + slack, long before the stall is over."""
    env = {"MTP_TEST_COLLECTIVE_TIMEOUT": "3", "MTP_FAULT_STALL": f"{stalled}:3:60"}
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", sys.executable, str(WORKER), str(checkpoint),
           str(tmp_path / "out.json"), "ok", str(tp), str(ep), "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**ENV, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)  # fmt: skip
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, err[-3000:]
    lines = our_lines(err, PROG)
    assert lines and all(WATCHDOG_LINE.match(line) for line in lines), err[-3000:]
    ranks = {int(WATCHDOG_LINE.match(line).group(1)) for line in lines}  # type: ignore[union-attr]
    assert ranks - {stalled}, f"no waiting rank reported the stall: {lines}"
    assert "Traceback" not in err
    assert elapsed < 55, f"the job took {elapsed:.0f} s: the watchdog did not end it (the stall lasts 60 s)"


@pytest.mark.parametrize("victim", [0, 1], ids=["kill-9-leader", "kill-9-follower"])
def test_killed_rank_ends_every_rank_within_30s(checkpoint, tmp_path, victim):
    out = tmp_path / "out.json"
    cmd = [str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable, str(WORKER), str(checkpoint), str(out),
           "kill", "2", "2", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pid_files = [Path(f"{out}.pid{r}") for r in range(2)]
        deadline = time.monotonic() + 180
        while not all(p.is_file() and p.read_text() for p in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, "ranks never started serving"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in pid_files]
        time.sleep(1.0)  # the leader is stepping, the follower replaying
        os.kill(pids[victim], signal.SIGKILL)
        sent_at = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0 and "Traceback" not in err, err[-2000:]
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() - sent_at < 30, "a rank outlived the job by 30 s"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_tp_ranks_with_different_settings_exit_with_one_line(checkpoint, tmp_path):
    """A follower started with another K would replay calls of a different shape: start-up refuses it."""
    out = tmp_path / "out.json"
    app = [sys.executable, WORKER, checkpoint, out, "ok", "2", "2"]
    cmd = [str(MPIRUN), "--oversubscribe", "-np", "1", *map(str, app), "1", ":", "-np", "1", *map(str, app), "2"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert our_lines(proc.stderr, PROG) == [
        f"{PROG}: error: ranks disagree on runtime.num_draft_tokens: rank 0 has 1, rank 1 has 2; "
        "launch every rank with the same engine and flags"], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
