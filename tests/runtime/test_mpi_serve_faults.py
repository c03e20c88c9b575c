"""`mpirun mtp-serve` when a rank stalls mid-request (issue 31): the leader's collective watchdog ends the job, and
before the rank leaves every request in flight ends with the watchdog's line as its error - HTTP 500 for a plain
request, an error event then `[DONE]` for a stream - instead of a bare disconnect. TP2 on models/tiny, no build
(the torch executor); rank 1 (the follower) held in its step-3 main forward by MTP_FAULT_STALL."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

from runtime.serving.process import free_ports
from tests.runtime.test_mpi_lockstep import ENV, MPIRUN, ROOT, our_lines
from tests.runtime.test_mpi_lockstep import pytestmark as needs_mpirun
from tests.runtime.test_mpi_tp import MTP_SERVE, TINY

pytestmark = needs_mpirun
WATCHDOG = "step 3: main forward did not complete within 3 s (rank 1 is not in a collective: step 3, main forward"


def _request(port: int, body: dict) -> urllib.request.Request:
    return urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"})  # fmt: skip


def _plain(port: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 48, "temperature": 0}
    try:
        with urllib.request.urlopen(_request(port, body), timeout=90) as r:
            out["plain"] = (r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        out["plain"] = (e.code, e.read().decode())
    except Exception as e:  # the connection dropped: what this test exists to rule out
        out["plain"] = ("disconnected", repr(e))


def _stream(port: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": "import os", "max_tokens": 48, "temperature": 0, "stream": True}
    lines: list[str] = []
    try:
        with urllib.request.urlopen(_request(port, body), timeout=90) as r:
            lines += [raw.decode().strip() for raw in r if raw.strip()]
        out["stream"] = lines
    except Exception as e:
        out["stream"] = [*lines, f"disconnected: {e!r}"]


def test_a_stalled_rank_fails_the_requests_in_flight_with_the_watchdogs_line():
    port = free_ports(1)[0]
    cmd = [str(MPIRUN), "-np", "2", "--oversubscribe", str(MTP_SERVE), "--frontend", "openai", "--checkpoint",
           str(TINY), "--tp-size", "2", "--num-draft-tokens", "2", "--port", str(port), "--collective-timeout", "3",
           "--acceptance-check", "off"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**ENV, "MTP_FAULT_STALL": "1:3:60"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    out: dict = {}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server never became ready"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
                break
            except OSError:
                time.sleep(0.5)
        clients = [threading.Thread(target=fn, args=(port, out)) for fn in (_stream, _plain)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(120)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, err[-2000:]
    assert any(WATCHDOG in line for line in our_lines(err, "mtp-serve")), err[-2000:]
    status, text = out["plain"]
    assert status == 500 and WATCHDOG in json.loads(text)["error"]["message"], out["plain"]
    events = out["stream"]
    assert events[-1] == "data: [DONE]" and WATCHDOG in events[-2], events
