"""The figures of docs/RUNTIME.md "Across hosts" fault table (issue 31), measured on two namespace hosts
(tests/multihost.py; root). Not a test: run it against an EP2 engine of models/tiny,

    mtp-build --checkpoint models/tiny --output /tmp/ep2 --compile none --world-size 2 --ep-size 2 \\
        --num-draft-tokens 2 --max-seq-len 128 --max-batch 4
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.runtime.host_fault_figures /tmp/ep2 host host rank stall

Each fault lands while both ranks are inside decode step 3 (rank 1 held there by MTP_FAULT_STALL=1:3:600):
host:   every process of host B killed;   daemon: only B's Open MPI daemon (prted);
rank:   only B's rank;                    stall:  nothing killed (rank 1 stays stalled);
cut:    host B's link down (its root-side veth: the cable pulled) until every process is gone or the wait gave up;
cut-keepalive: the same, with the daemons' short TCP keepalive on the launch line (tests/multihost.py KEEPALIVE_ARGS);
slow:QDISC: no fault, every host's sends shaped by `tc qdisc add dev eth0 root QDISC` for the whole run (K=2, 16
        tokens): exit status, seconds, ids; e.g. "slow:netem delay 50ms", "slow:tbf rate 64kbit burst 1600 latency 30s",
        "slow:" (unshaped).
Prints, per run: mpirun's exit status, seconds from the fault to mpirun's exit and until no process is left in
either host, and the lines from the engine and the launcher's banner heads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from tests.multihost import KEEPALIVE_ARGS, link_down, namespace_hosts, qdisc_unavailable, shaped_link
from tests.runtime.test_mpi_hosts import (
    MTP_RUN,
    PROMPTS,
    _rank_pid,
    _start_held_in_step_3,
    _wait_empty,
    launch,
    our_lines,
    records,
)

BANNERS = ("mtp-run", "PRTE has lost", "A daemon failed to report", "prterun noticed that")
TIMEOUT_S = 20


def once(engine: str, mode: str) -> str:
    with TemporaryDirectory() as tmp, namespace_hosts(Path(tmp)) as hosts:
        keepalive = KEEPALIVE_ARGS if mode == "cut-keepalive" else ()
        try:
            proc = _start_held_in_step_3(hosts, Path(engine), TIMEOUT_S, *keepalive)
        except AssertionError as e:
            return f"{mode}: {e}"
        pid = _rank_pid(hosts, hosts.names[1])
        assert pid, "rank 1 left before the fault"
        t0 = time.monotonic()
        b = hosts.names[1]
        if mode == "host":
            hosts.kill_all(b)
        elif mode == "daemon":
            for p in hosts.pids(b):
                if b"prted" in Path(f"/proc/{p}/cmdline").read_bytes():
                    os.kill(p, signal.SIGKILL)
        elif mode == "rank":
            os.kill(pid, signal.SIGKILL)
        cut = link_down(hosts, b) if mode.startswith("cut") else contextlib.nullcontext()
        with cut:  # the cable stays out until every process is gone (or the wait gave up)
            out, err = _wait_job(hosts, proc)
            ended = time.monotonic() - t0
            left = _wait_empty(hosts, 2 * TIMEOUT_S + 30)
            gone = time.monotonic() - t0
        lines = [line for line in (out + err).splitlines() if line.startswith(BANNERS)]
        return (f"{mode}: exit {proc.returncode}, mpirun over after {ended:.2f} s, all gone after {gone:.2f} s"
                f"{f' (left: {left})' if left else ''}; lines: {lines}")  # fmt: skip


def _wait_job(hosts, proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        for host in hosts.names:
            hosts.kill_all(host)
        out, err = proc.communicate()
        return out, err + "[mpirun timed out]"


def slow(engine: str, qdisc: str) -> str:
    """The slow-link row: the EP2 run (K=2) with every host's sends shaped by `tc qdisc ... QDISC` ("" = none)."""
    reason = qdisc_unavailable(qdisc.split()[0]) if qdisc else None
    if reason:
        return f"slow:{qdisc}: not measured: {reason}"
    flags = [*PROMPTS, "--max-tokens", "16", "--json", "--num-draft-tokens", "2", "--prefill-chunk", "2"]
    with TemporaryDirectory() as tmp, namespace_hosts(Path(tmp)) as hosts:
        shaped = shaped_link(hosts, qdisc.split()) if qdisc else contextlib.nullcontext()
        with shaped:
            status, out, err, secs = launch(hosts, [*MTP_RUN, "--engine", engine, *flags], timeout=600)
    ids = [r["output_ids"] for r in records(out)[:3]]
    return f"slow:{qdisc or 'none'}: exit {status}, {secs:.1f} s, lines {our_lines(err)}, ids {ids}"


def main(argv: list[str]) -> int:
    engine, modes = argv[0], argv[1:] or ["host", "daemon", "rank", "stall", "cut", "cut-keepalive"]
    for mode in modes:
        print(slow(engine, mode[5:]) if mode.startswith("slow:") else once(engine, mode), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
