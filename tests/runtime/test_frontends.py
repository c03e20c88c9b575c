"""Behaviour both serving frontends must share, pinned by one suite run against each (tests/runtime/frontends.py):
a bounded drain on every terminating signal (with long streams in flight), the abort of a request whose client
went away, the admission errors, and the sampling-parameter rules. Real `mtp-serve` processes on loopback."""

from __future__ import annotations

import json
import signal
import socket
import struct
import threading
import time

import pytest
import tritonclient.grpc as grpcclient

from tests.runtime import serve_helpers as h
from tests.runtime.frontends import FRONTENDS, Result, Served

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
LONG_PROMPT = "x = 1\n" * 20  # the tiny model runs this to max_seq_len: streams last several seconds
WAIT_S = 180  # generous bound for anything the server must do by itself: the machine may be loaded


def _streams(srv: Served, n: int, max_tokens: int) -> tuple[list[threading.Thread], dict[int, Result], threading.Event]:
    """n streams in threads; the event is set once every one of them has its first response (h.AllStarted)."""
    results: dict[int, Result] = {}
    every = h.AllStarted(n)

    def run(i: int) -> None:
        try:
            results[i] = srv.stream(LONG_PROMPT, max_tokens, on_first=lambda _r: every.began(i), temperature=1.0, seed=i)
        except Exception as e:  # noqa: BLE001 - recorded and asserted on
            results[i] = Result(False, f"client exception: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, every


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name)
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_signal_with_long_streams_drains_and_exits_0(tmp_path, frontend, sig):
    """Every terminating signal drains within --drain-timeout: each long stream ends with its final response (Triton
    FINAL, OpenAI `data: [DONE]`) or, cut at the bound, with a "shutting down" error; the process exits 0 and
    leaves no process, shared-memory region or work directory behind."""
    # SIGTERM: six 400-token streams under the default 30 s bound, which they finish within (the Triton frontend
    # used to exit 1 after ~37 s here); the other signals: a 3 s bound that cuts the streams short.
    drain = [] if sig == signal.SIGTERM else ["--drain-timeout", "3"]
    srv = Served(frontend, tmp_path, *drain)
    try:
        threads, results, first = _streams(srv, 6 if sig == signal.SIGTERM else 3, 400)
        assert first.wait(WAIT_S), "not every stream started"
        t0 = time.monotonic()
        srv.signal(sig)
        rc = srv.wait(WAIT_S)
        stop_s = time.monotonic() - t0
        for t in threads:
            t.join(WAIT_S)
        assert rc == 0, f"{frontend} {sig.name}: exit code {rc} after {stop_s:.1f} s:\n{srv.output()}"
        print(f"{frontend} {sig.name}: exit {rc} after {stop_s:.1f} s")
        assert stop_s < (30 if drain == [] else 3) + WAIT_S  # bounded; the margin is for a loaded machine
        for i, r in results.items():
            cut = r.error is not None and "shutting down" in r.error
            assert (r.ended and r.error is None) or cut, f"stream {i}: ended={r.ended} error={r.error!r}"
            if frontend == "openai":
                assert r.ended, f"stream {i} got no data: [DONE] ({r.error!r})"
        assert srv.leftovers() == [], f"left behind: {srv.leftovers()}"
    finally:
        srv.kill_all()


def _abandon(srv: Served, prompt: str, max_tokens: int) -> None:
    """Send one NON-streaming request and go away (connection reset) once the engine generates for it."""
    base = srv.generated_tokens()
    if srv.frontend == "triton":
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.ports[1]}")
        client.start_stream(callback=lambda result, error: None)
        client.async_stream_infer(h.MODEL_NAME, h.request_inputs(prompt, max_tokens, stream=False))
    else:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.ports[0]))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    deadline = time.monotonic() + WAIT_S
    while srv.generated_tokens() == base and time.monotonic() < deadline:
        time.sleep(0.02)
    if srv.frontend == "triton":
        client.stop_stream(cancel_requests=True)
        client.close()
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, as a killed client
        sock.close()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_abandoned_request_is_aborted_and_frees_its_slot(tmp_path, frontend):
    """A non-streaming request whose client went away stops generating at once (it used to run to max_tokens,
    holding its queue slot: other clients got 429 meanwhile)."""
    srv = Served(frontend, tmp_path, "--max-queue", "1")
    try:
        _abandon(srv, "def main(", 400)  # left alone, the tiny model generates all 400 tokens for it
        at_disconnect = srv.generated_tokens()
        deadline = time.monotonic() + WAIT_S
        while srv.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        after = srv.generated_tokens() - at_disconnect
        print(f"{frontend}: {after} tokens generated after the disconnect")
        assert srv.running() == 0
        assert after < 200, f"{after} of 400 tokens were generated after the client went away"
        r = srv.request("def main(", 4, temperature=0)  # the slot is free again: no 429
        assert r.error is None, r.error
    finally:
        srv.kill_all()


@pytest.fixture(scope="module", params=FRONTENDS)
def served(request, tmp_path_factory):
    srv = Served(request.param, tmp_path_factory.mktemp(request.param), "--max-queue", "1", "--max-prompt-bytes", "2048")
    yield srv
    srv.signal(signal.SIGTERM)
    rc = srv.wait(WAIT_S)
    srv.kill_all()
    assert rc == 0 and srv.leftovers() == []


def _refused(r: Result, *needles: str) -> None:
    assert r.error is not None and all(n in r.error for n in needles), r.error
    assert r.status in (200, 400, 429, 503) and len(r.error.splitlines()) == 1


def test_prompt_over_the_byte_bound_is_refused(served):
    r = served.request("x" * 3000, 4)
    _refused(r, "3000 bytes", "--max-prompt-bytes")
    assert r.status == (400 if served.frontend == "openai" else 200)


def test_stop_strings_are_bounded(served):
    field = "stop" if served.frontend == "openai" else "stop_words"
    _refused(served.request("def main(", 4, stop=["a", "b", "c", "d", "e"]), field, "5 sequences", "at most 4")
    _refused(served.request("def main(", 4, stop=["x" * 300]), field, "300 characters", "at most 256")
    assert served.request("def main(", 4, stop=["a", "b", "c", "d"], temperature=0).error is None


@pytest.mark.parametrize(("sampling", "needle"), [
    ({"top_p": 0.0}, "top_p"),  # vLLM's rule on both frontends: (0, 1]; 1.0 is "off"
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
])  # fmt: skip
def test_sampling_parameter_rules(served, sampling, needle):
    args = {"max_tokens": 4, "temperature": 1.0, **sampling}
    _refused(served.request("def main(", args.pop("max_tokens"), **args), needle)
    assert served.request("def main(", 4, temperature=1.0, top_p=1.0, seed=3).error is None


def test_queue_full_is_refused_and_names_the_flag(served):
    threads, results, first = _streams(served, 1, 400)
    assert first.wait(WAIT_S)
    r = served.request("def main(", 2)
    _refused(r, "--max-queue")
    assert r.status == (429 if served.frontend == "openai" else 200)
    threads[0].join(WAIT_S)
    assert results[0].error is None and results[0].ended
