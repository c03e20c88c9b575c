"""mtp-serve lifecycle faults, on the real CLI, tritonserver and stub: SIGTERM under load, SIGKILL of mtp-serve,
a killed stub, an immediate restart on the same ports; plus the port probe against TIME_WAIT.

Every test ends with nothing of ours left: no process, no /dev/shm region, no work dir.
"""

from __future__ import annotations

import glob
import os
import queue
import signal
import socket
import tempfile
import threading
import time
import urllib.request

import pytest
import tritonclient.grpc as grpcclient

from runtime.serving.process import SHM_PREFIX, STUB_COMM, WORKDIR_PREFIX, children, pid_alive, port_is_free
from runtime.serving.triton_server import free_ports
from tests.runtime import serve_helpers as h

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
LONG_PROMPT = "x = 1\n" * 20  # the tiny model runs this to max_seq_len: streams last several seconds


def _ours(pid: int) -> tuple[list[str], list[str]]:
    """shm regions and work dirs named after owner pid (mtp-serve's PID)."""
    return (glob.glob(f"/dev/shm/{SHM_PREFIX}_mtp{pid}x*"), glob.glob(f"{tempfile.gettempdir()}/{WORKDIR_PREFIX}{pid}_*"))


def _streams(port: int, n: int, max_tokens: int = 480) -> tuple[list[threading.Thread], dict, threading.Event]:
    """n streams in threads; the event is set once every one has a response (h.AllStarted)."""
    results: dict[int, tuple] = {}
    every = h.AllStarted(n)

    def run(i: int) -> None:
        try:
            results[i] = h.generate(port, LONG_PROMPT, max_tokens, temperature=1.0, seed=i,
                                    on_response=lambda _r: every.began(i))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded and asserted on
            results[i] = ([], f"client exception: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, every


def test_port_probe_ignores_time_wait():
    """TIME_WAIT on the port (left by the previous server's closed connections) must not refuse a restart."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: ITS end (local port = port) goes to TIME_WAIT
    time.sleep(0.05)
    client.close()
    listener.close()
    time.sleep(0.05)
    assert port_is_free(port), "a port in TIME_WAIT was reported busy"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        assert not port_is_free(busy.getsockname()[1]), "a listening port was reported free"


def _held_stream(port: int):
    """A client that sends one short request, reads its last response and keeps the gRPC stream open (how
    Triton clients usually talk). Returns the client; the caller closes it."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(h.MODEL_NAME, h.request_inputs("def main(", 4), enable_empty_final_response=True)
    while True:
        result, error = got.get(timeout=h.RESPONSE_TIMEOUT_S)
        assert error is None, error
        if h.is_final(result):
            return client


def test_sigterm_under_load_drains_exits_zero_and_restarts(tmp_path):
    """Six long streams and one idle stream a client keeps open (issue 31 item 7: Triton 2.51 then never unloads
    the model, its exit timeout expires and it does not exit; mtp-serve used to SIGKILL it 25 s later and exit 1)."""
    ports = free_ports(3)
    serve = h.MtpServe(tmp_path / "repo", ports, "--drain-timeout", "1.5")
    held = None
    try:
        serve.wait_ready()
        held = _held_stream(ports[1])
        threads, results, first = _streams(ports[1], 6)
        assert first.wait(60), "not every stream started"
        t0 = time.monotonic()
        serve.signal(signal.SIGTERM)
        time.sleep(0.5)  # the model sees the drain file within 0.1 s; the 1.5 s drain is still running
        late_responses, late_error = h.generate(ports[1], "def main(", 4)
        rc = serve.wait(60)
        stop_s = time.monotonic() - t0
        for t in threads:
            t.join(60)
        held.stop_stream()
        held.close()
        held = None
        assert rc == 0, f"mtp-serve exit code {rc}:\n{serve.output()}"
        assert "stopped (every request had ended; tritonserver 10 s after SIGTERM" in serve.output(), serve.output()
        assert stop_s < 1.5 + 10 + 12, f"stop took {stop_s:.1f} s"  # drain + Triton's exit timeout + slack
        assert late_error is not None and "shutting down (draining)" in late_error and not late_responses, late_error
        assert len(results) == 6
        for i, (responses, error) in results.items():  # each stream ended exactly once: FINAL, or the drain error
            finals = [r for r in responses if h.is_final(r)]
            if error is None:
                assert len(finals) == 1 and responses[-1] is finals[0], f"stream {i}: {len(finals)} finals"
            else:
                assert "shutting down" in error and not finals, f"stream {i}: {error!r}"
        cut = [i for i, (_, e) in results.items() if e is not None]
        assert cut, "the 1.5 s drain bound should have cut some of the long streams short"
        assert h.wait_gone([serve.server_pid, *serve.stub_pids], 5) == []
        assert h.group_members(serve.server_pid) == []
        assert _ours(serve.proc.pid) == ([], []), "shm regions or work dir left behind"
        # an immediate restart on the same ports (TIME_WAIT from the streams' connections is on them)
        again = h.MtpServe(tmp_path / "repo2", ports)
        try:
            again.wait_ready()
            responses, error = h.generate(ports[1], "def main(", 4)
            assert error is None and len(h.ids_of(responses)) == 4
            again.signal(signal.SIGTERM)
            assert again.wait(60) == 0, again.output()
        finally:
            again.kill_all()
    finally:
        if held is not None:
            held.close()
        serve.kill_all()


def test_sigkill_of_mtp_serve_takes_the_server_down(tmp_path):
    ports = free_ports(3)
    serve = h.MtpServe(tmp_path / "repo", ports)
    try:
        serve.wait_ready()
        owner = serve.proc.pid
        assert _ours(owner)[0], "expected shm regions while serving"
        serve.proc.kill()
        serve.wait(10)
        assert h.wait_gone([serve.server_pid, *serve.stub_pids], 10) == [], "tritonserver or stub outlived mtp-serve"
        assert all(port_is_free(p) for p in ports), "something still listens on the ports"
        # the next start cleans up what the killed owner could not
        again = h.MtpServe(tmp_path / "repo2", ports)
        try:
            again.wait_ready()
            assert _ours(owner) == ([], []), "stale shm / work dir of the killed mtp-serve not swept"
            again.signal(signal.SIGTERM)
            assert again.wait(60) == 0, again.output()
        finally:
            again.kill_all()
    finally:
        serve.kill_all()


def test_killed_stub_is_detected(tmp_path):
    ports = free_ports(3)
    serve = h.MtpServe(tmp_path / "repo", ports)
    try:
        serve.wait_ready()
        assert serve.stub_pids and children(serve.server_pid, STUB_COMM) == serve.stub_pids
        os.kill(serve.stub_pids[0], signal.SIGKILL)
        rc = serve.wait(30)
        assert rc not in (0, None), f"mtp-serve exit code {rc} after its stub died:\n{serve.output()}"
        assert "stub" in serve.output() and "died" in serve.output(), serve.output()
        assert not pid_alive(serve.server_pid)
        with pytest.raises(OSError):  # nothing answers readiness any more
            urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/models/mtp/ready", timeout=2)
        assert _ours(serve.proc.pid) == ([], [])
    finally:
        serve.kill_all()
