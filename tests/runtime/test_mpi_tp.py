"""Tensor parallelism under a real `mpirun --oversubscribe`: the TP leader runs the engine, its followers replay
every executor call (runtime/multirank/tp_group.py); outputs equal the single-rank run; a killed, stalled or differently
configured rank ends every rank with one line. Every launch has a timeout, so a hang fails the test.

Mappings (tests/runtime/mpi_tp_worker.py, a random tiny 4-expert checkpoint sharded at load per the mapping
contract, torch executor; and `mtp-build --tp-size` engines of models/tiny, run by onnxruntime and, the TP2 one
built with --compile aoti, by the compiled executor): TP2 (= TP2 with EP2: with 2 ranks the contract puts the routed experts on both), DP2 x TP2
with EP4 (4 ranks: two schedules in DP lockstep over the leaders comm, experts exchanged over each column),
DP2 x TP2 with EP2 (no expert exchange) and EP4 without TP; each runs K = 0, 1, 2 and 3 (DP2 x TP2/EP4 also
`auto`, agreed over the leaders comm) with chunked prefill (8-token chunks), a prefix hit and late
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
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.conftest import TINY_TP_BUILD_FLAGS
from tests.runtime.mpi_tp_worker import SETTINGS, prompts
from tests.runtime.test_mpi_lockstep import ENV, MPIRUN, ROOT, _alive, our_lines
from tests.runtime.test_mpi_lockstep import pytestmark as needs_mpirun

# `mtp-build --check` of the TP2 engine (each rank's packages under mpirun against its torch shard) is
# tests/builder/test_tp_build.py's test_check_accepts_each_rank, on the same session build.
# The first test to use tp2_engine pays its build: two ranks' ONNX exports and AOTInductor compiles (measured
# 13-21 min for a 2-rank compiled build on the shared 2-core machine at load ~10, the compiles 3-6 min per rank).
# Every launch below has its own, shorter, timeout, so a hang still fails fast.
pytestmark = [needs_mpirun, pytest.mark.timeout(2400)]

WORKER = ROOT / "tests/runtime/mpi_tp_worker.py"
TINY = ROOT / "models" / "tiny"
PROG = "mpi_tp_worker"


def launch(np_: int, *args, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", sys.executable, str(WORKER), *map(str, args)]
    return subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_ckpt")
    make_checkpoint(path, tiny_config(n_routed_experts=4, n_group=2, topk_group=1), seed=11)
    return path


def single_rank_outputs(checkpoint) -> dict[str, list[int]]:
    """Single rank, K=0, no chunking: the greedy output ids of every prompt (lossless: any K, chunk, batch)."""
    engine = create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=0,
                           **{**SETTINGS, "max_prefill_chunk": 64})  # fmt: skip
    first, late = prompts(min(96, engine.model_cfg.vocab_size))  # as the worker draws them
    outs = engine.generate(first + late, SamplingParams(max_tokens=12))
    ids = [f"a{i}" for i in range(len(first))] + [f"b{i}" for i in range(len(late))]
    return {i: o.output_ids for i, o in zip(ids, outs, strict=True)}


@pytest.fixture(scope="module")
def reference(checkpoint):
    return single_rank_outputs(checkpoint)


def build(out: Path, world: int, tp: int, ep: int, *extra: str) -> Path:
    from builder import cli as build_cli

    assert build_cli.main(["--checkpoint", str(TINY), "--output", str(out), "--compile", "none", "--world-size", str(world), "--tp-size",
                           str(tp), "--ep-size", str(ep), *TINY_TP_BUILD_FLAGS, *extra]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def tp2_engine(tiny_tp2_engine):
    """The shipped tiny model built with --tp-size 2 --compile aoti (the session's, tests/conftest.py: shared with
    tests/builder/test_tp_build.py): per rank, the ONNX graphs (AllReduce/AllGather nodes, what onnxruntime runs) and
    the AOTInductor packages (what `auto` runs). One build serves both executors: compiling is its slow part."""
    return tiny_tp2_engine


@pytest.fixture(scope="module")
def tiny_reference() -> dict[str, list[int]]:
    return single_rank_outputs(TINY)


@pytest.mark.parametrize("np_,tp,ep,ks", [(2, 2, 2, "0,1,2,3,per-request"), (4, 2, 4, "0,1,2,3,auto,per-request"),
                                         (4, 2, 2, "0,1,2,3"),
                                         (4, 1, 4, "0,1,2,3")],
                         ids=["TP2-EP2", "DP2xTP2-EP4", "DP2xTP2-EP2", "EP4"])  # fmt: skip
def test_tp_outputs_equal_single_rank(checkpoint, reference, tmp_path, np_, tp, ep, ks):
    out = tmp_path / "out.json"
    proc = launch(np_, checkpoint, out, "ok", tp, ep, ks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for k, res in results.items():
        assert res["outputs"] == reference, f"K={k}"
        calls = res["calls"]  # every follower ran exactly its leader's executor calls
        assert all(calls[r] == calls[r - r % tp] for r in range(np_)), (k, calls)
        assert min(calls) > 0
        assert res["heads"] == [tiny_config().num_attention_heads // tp] * np_  # really sharded


@pytest.mark.parametrize("np_,tp,ep", [(2, 2, 2), (4, 2, 4)], ids=["TP2", "DP2xTP2-EP4"])
def test_tp_onnxruntime_engines_equal_single_rank(request, tiny_reference, tmp_path, np_, tp, ep):
    """Engines built by `mtp-build --tp-size`: each rank runs its own shard graphs under onnxruntime. The 4-rank one
    is the session's (tests/conftest.py: the same flags as build() here), shared with tests/builder/test_tp_build.py."""
    engine = request.getfixturevalue("tp2_engine" if np_ == 2 else "tiny_dp2tp2_ep4_engine")
    out = tmp_path / "out.json"
    proc = launch(np_, engine, out, "ok", tp, ep, "0,1,2,3", env={"MTP_TEST_EXECUTOR": "onnxruntime"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k, res in json.loads(out.read_text()).items():
        assert res["outputs"] == tiny_reference, f"K={k}"
        assert all(res["calls"][r] == res["calls"][r - r % tp] for r in range(np_)), (k, res["calls"])
        assert res["executors"] == ["OrtExecutor"] * np_


def test_tp_compiled_engine_equals_single_rank(tp2_engine, tiny_reference, tmp_path):
    """The TP2 (EP2) engine's AOTInductor packages under mpirun, picked by `auto`: each rank's packages call the
    collectives (all-reduce, all-gather, the experts split over the TP group) through the dispatcher. Greedy ids
    equal the single-rank torch run at K=0 (itself HF-identical) at K=0 and K=2, with 8-token prefill chunks
    (prompts up to 20) and prefix-cache hits."""
    out = tmp_path / "out.json"
    proc = launch(2, tp2_engine, out, "ok", 2, 2, "0,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k, res in json.loads(out.read_text()).items():
        assert res["executors"] == ["CompiledExecutor"] * 2, k
        assert res["outputs"] == tiny_reference, f"K={k}"
        assert res["calls"][0] == res["calls"][1] > 0, (k, res["calls"])
        assert res["prefix_hit_tokens"] > 0, k
        assert min(res["collective_seconds"]) > 0, k  # the packages really ran the collectives


def test_idle_leader_does_not_trip_the_watchdog(checkpoint, tmp_path):
    """The leader idles 2.5 x the timeout between two steps (a server without requests): followers wait
    unarmed, so the job completes."""
    out = tmp_path / "out.json"
    proc = launch(2, checkpoint, out, "idle", 2, 2, "1", env={"MTP_TEST_COLLECTIVE_TIMEOUT": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(out.read_text())["1"]["outputs"]) == 6


WATCHDOG_LINE = re.compile(r"^mpi_tp_worker: error: \[rank (\d)\] step 3: (.+) did not complete within 3 s "
                           r"\((.+)\); exiting$")  # fmt: skip


@pytest.mark.parametrize("np_,tp,ep,stalled", [(2, 2, 2, 1), (4, 2, 4, 2)], ids=["TP2-follower", "DP2xTP2-leader"])
def test_forced_stall_becomes_the_watchdogs_error(checkpoint, tmp_path, np_, tp, ep, stalled):
    """MTP_FAULT_STALL makes one rank sleep 60 s inside its step-3 main forward; with --collective-timeout 3 the
    ranks waiting on it print the watchdog's line (the stalled rank's own deadline is one timeout later, so they
    report first) and the job ends non-zero within timeout + slack, long before the stall is over. A waiting rank's
    line names the stalled one: before leaving it asks the others (runtime/multirank/peer_probe.py) and only the
    stalled rank answers that it is not inside a collective."""
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
    waiting = [line for line in lines if not line.startswith(f"{PROG}: error: [rank {stalled}]")]
    why = [WATCHDOG_LINE.match(line).group(3) for line in waiting]  # type: ignore[union-attr]
    # (a rank that fires after another left also names that one as gone)
    assert all(f"rank {stalled} is not in a collective: step 3, main forward, armed " in w for w in why), why
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


# ---------------------------------------------------------------------- the CLIs under mpirun (real TP shards)
MTP_RUN, MTP_SERVE = (Path(sys.executable).parent / name for name in ("mtp-run", "mtp-serve"))
RUN_ARGS = ["--prompt", "def main(", "--prompt", "import os", "--prompt", "class A:", "--max-tokens", "16", "--json",
            "--num-draft-tokens", "2"]  # fmt: skip


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("source", ["engine", "checkpoint"])
def test_mtp_run_tp2_equals_single_process(tp2_engine, source):
    """`mpirun -np 2 mtp-run --engine TP2` (its compiled packages: `auto`) and `--checkpoint tiny --tp-size 2` (torch,
    sharded at load): ids and acceptance equal the single process; only the leader prints."""
    model = ["--engine", str(tp2_engine)] if source == "engine" else ["--checkpoint", str(TINY), "--tp-size", "2"]
    tp = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", str(MTP_RUN), *model, *RUN_ARGS], env=ENV,
                        capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    single = subprocess.run([str(MTP_RUN), "--checkpoint", str(TINY), *RUN_ARGS], env=ENV, capture_output=True,
                            text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert tp.returncode == 0 and single.returncode == 0, tp.stderr[-2000:] + single.stderr[-2000:]
    got, want = _json_lines(tp.stdout), _json_lines(single.stdout)
    assert len(got) == 4, "the follower must not print"
    for a, b in zip(got[:3], want[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]


def _rank_pid(mpirun_pid: int, rank: int, timeout: float = 120) -> int:
    """The pid of one rank: a child of mpirun whose environment says OMPI_COMM_WORLD_RANK=rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{mpirun_pid}/task/{mpirun_pid}/children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
                return int(child)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _post(port: int, path: str, body: dict | None = None) -> dict:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_mtp_serve_openai_tp2_serves_idles_and_drains(tp2_engine):
    """`mpirun -np 2 mtp-serve --frontend openai --engine TP2`: rank 0 serves HTTP, rank 1 follows; idling
    past --collective-timeout trips nothing; greedy text equals the single process; SIGTERM to the leader
    drains and stops the follower (every rank exits 0)."""
    from runtime.serving.process import free_ports

    port = free_ports(1)[0]
    cmd = [str(MPIRUN), "-np", "2", "--oversubscribe", str(MTP_SERVE), "--frontend", "openai", "--engine",
           str(tp2_engine), "--num-draft-tokens", "2", "--port", str(port), "--collective-timeout", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        leader = _rank_pid(proc.pid, 0)
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server never became ready"
            try:
                _post(port, "/v1/models")
                break
            except OSError:
                time.sleep(0.5)
        time.sleep(5)  # idle: no step in progress, so no deadline is armed anywhere
        body = {"model": "tiny", "prompt": "def main(", "max_tokens": 16, "temperature": 0}
        got = _post(port, "/v1/completions", body)["choices"][0]["text"]
        want = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=2).generate(
            ["def main("], SamplingParams(max_tokens=16))[0].text
        assert got == want
        os.kill(leader, signal.SIGTERM)  # mpirun does not forward SIGTERM: a drain is asked of the leader
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert "mtp-serve: stopped (drained)" in out and "error" not in err, out + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("frontend", ["openai", "triton"])
def test_mtp_serve_refuses_what_it_cannot_serve_under_mpirun(tmp_path, frontend):
    """openai with 2 DP groups (one HTTP server per schedule is not built) / triton (its model lives outside the
    MPI job): one line from rank 0, every rank exits 2."""
    extra = ["--model-repo", str(tmp_path / "repo")] if frontend == "triton" else []
    proc = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", str(MTP_SERVE), "--frontend", frontend,
                           "--checkpoint", str(TINY), *extra], env=ENV, capture_output=True, text=True, timeout=240,
                          cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = our_lines(proc.stderr, "mtp-serve")
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("2 data-parallel groups" if frontend == "openai" else "--frontend triton cannot run under mpirun") in lines[0]


def test_a_host_without_the_engines_isa_ends_start_up_with_one_line(tp2_engine, tmp_path):
    """Issue 31, start-up agreement across hosts, the CPU half: the TP2 engine's compiled packages are native code
    for this CPU's vector ISA; host B's rank runs with ATEN_CPU_CAPABILITY=default (what torch sees on a CPU without
    it). Launched per host across two namespace hosts (`mpirun A : B`): the job ends before any step with one line
    naming both hosts and both ISAs, nothing left running in either host."""
    from runtime.multirank.host_facts import host_facts
    from tests.multihost import leftovers, namespace_hosts, unavailable
    from tests.runtime.test_mpi_hosts import launch as launch_across

    if unavailable():
        pytest.skip(unavailable() or "")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        pytest.skip("this process already runs with ATEN_CPU_CAPABILITY=default: nothing to lower")
    run = [str(MTP_RUN), "--engine", str(tp2_engine), *RUN_ARGS[:2], "--max-tokens", "4", "--collective-timeout", "60"]
    with namespace_hosts(tmp_path / "hosts") as hosts:
        status, out, err, _ = launch_across(hosts, run, 300, argv_b=["env", "ATEN_CPU_CAPABILITY=default", *run])
        left = {host: hosts.pids(host) for host in hosts.names}
    assert leftovers(hosts) == [] and left == {host: [] for host in hosts.names}, left
    assert status != 0 and not _json_lines(out), out + err
    mine = host_facts(True)["host.cpu_isa"]
    lines = [line for line in err.splitlines() if line.startswith("mtp-run")]
    assert len(lines) == 1 and lines[0].startswith(
        f"mtp-run: error: ranks disagree on host.cpu_isa: rank 0 ({hosts.names[0]}) has {mine!r}, rank 1 "
        f"({hosts.names[1]}) has "), err  # fmt: skip
    assert "Traceback" not in err
