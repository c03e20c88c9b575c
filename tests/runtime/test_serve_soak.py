"""Soak through the real server: many requests at bounded concurrency, with random client aborts (gRPC cancel)
and client disconnects (a client process SIGKILLed mid-stream), on a KV pool small enough to preempt.

Checks: every request reaches the engine once and ends exactly once (server outcome counters: admitted ==
finished + cancelled + failed == requests sent, none failed), every completed stream got exactly one FINAL,
zero KV blocks held once idle, and the stub's RSS stays within RSS_BOUND_MIB of its level after warm-up.
CI runs MTP_SOAK_REQUESTS=200 (the default); `make soak` runs 2,000. The figures are printed
(`-s`) as one `SOAK` line.

The bundled tritonserver (2.51, nvidia-pytriton 0.7.0) sometimes aborts in its own gRPC stream code while a client
cancels (its log: `API misuse of type GRPC_CALL_ERROR_TOO_MANY_OPERATIONS`, signal 6; upstream races on gRPC
cancellation fixed in later Triton releases, docs/RELIABILITY.md). When the server died with exactly that line, the
soak runs once more on a fresh server and says so; any other failure, or that abort twice, fails the test.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from runtime.serving.triton_server import MODEL_NAME, TritonServer, free_ports, write_model_repo
from tests.runtime import serve_helpers as h

NUM_REQUESTS = int(os.environ.get("MTP_SOAK_REQUESTS", "200"))
CONCURRENCY = 8
DISCONNECT_BATCH = 6  # streams per client process that gets SIGKILLed
P_ABORT, P_DISCONNECT = 0.15, 0.04
NUM_BLOCKS = 34  # with max_batch 8 and these lengths, the pool runs out: requests get preempted
RSS_BOUND_MIB = 64
WARMUP = 16
PROMPTS = ["def main(", "import numpy as np\n", "class Foo:\n    def __init__(self", "for i in range(",
           "x = 1\n" * 12, "# a comment\n" * 6]  # fmt: skip

pytestmark = [pytest.mark.timeout(2 * max(300, NUM_REQUESTS)), pytest.mark.slow]  # two attempts at most


def _params(rng: random.Random) -> dict:
    return {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 96), "temperature": 1.0,
            "seed": rng.randrange(1 << 30)}  # fmt: skip


def _normal(port: int, p: dict) -> str:
    responses, error = h.generate(port, p["prompt"], p["max_tokens"], temperature=p["temperature"], seed=p["seed"])
    if error is not None:
        return f"error: {error}"
    finals = [r for r in responses if h.is_final(r)]
    if len(finals) != 1 or responses[-1] is not finals[0]:
        return f"{len(finals)} FINAL responses"
    return "ok"


def _abort(port: int, p: dict, rng: random.Random) -> str:
    """Cancel after a random number of responses. "early": cancelled before any response, so Triton may drop
    it before it reaches the model: such a request is allowed to be never admitted."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    after = rng.randint(0, 3)
    try:
        client.async_stream_infer(MODEL_NAME, h.request_inputs(p["prompt"], 400, True, temperature=1.0, seed=p["seed"]),
                                  enable_empty_final_response=True)  # fmt: skip
        for _ in range(after):
            result, error = results.get(timeout=h.RESPONSE_TIMEOUT_S)
            if error is not None or h.is_final(result):
                break
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return "ok" if after else "early"


DISCONNECTOR = """
import sys, threading, time
from tests.runtime import serve_helpers as h
port, n, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
started = threading.Semaphore(0)
def run(i):
    first = threading.Event()  # release once per stream: STARTED must mean every stream reached the model
    def on_response(r):
        if not first.is_set():
            first.set()
            started.release()
    h.generate(port, "x = 1\\n" * 12, 400, temperature=1.0, seed=seed + i, on_response=on_response)
for i in range(n):
    threading.Thread(target=run, args=(i,), daemon=True).start()
for i in range(n):
    started.acquire()
print("STARTED", flush=True)
time.sleep(600)
"""


def _disconnect(port: int, seed: int) -> str:
    """DISCONNECT_BATCH streams from a client process that is SIGKILLed once each has a response."""
    env = dict(os.environ, PYTHONPATH=str(h.ROOT))
    proc = subprocess.Popen([sys.executable, "-c", DISCONNECTOR, str(port), str(DISCONNECT_BATCH), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=h.ROOT)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        return "ok" if line.startswith(b"STARTED") else f"disconnector said {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


UPSTREAM_GRPC_ABORT = "GRPC_CALL_ERROR_TOO_MANY_OPERATIONS"


def _soak_on_a_fresh_server(root: Path) -> None:
    repo = write_model_repo(root / "soak_repo", checkpoint=h.TINY, executor="torch", num_draft_tokens=2, threads=1,
                            num_blocks=NUM_BLOCKS)  # fmt: skip
    srv = TritonServer(repo, *free_ports(3), log_path=root / "soak_log" / "tritonserver.log")
    try:
        srv.start()
        srv.wait_ready(90)
        _soak(srv)
    finally:
        rc = srv.stop(drain_timeout_s=5)
    assert rc == 0 and not h.leftovers(srv), (rc, h.leftovers(srv))


def _wait_idle(srv: TritonServer, admitted: int, timeout_s: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = h.metrics(srv.metrics_port)
        ended = sum(h.outcome(m, o) for o in ("finished", "cancelled", "failed"))
        if h.outcome(m, "admitted") >= admitted and ended >= h.outcome(m, "admitted") and \
                h.gauge(m, "mtp_requests_active") == 0:  # fmt: skip
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_soak(tmp_path):
    for attempt in (1, 2):
        try:
            _soak_on_a_fresh_server(tmp_path / f"attempt{attempt}")
            return
        except Exception:
            log = tmp_path / f"attempt{attempt}" / "soak_log" / "tritonserver.log"
            if attempt == 2 or not log.exists() or UPSTREAM_GRPC_ABORT not in log.read_text(errors="replace"):
                raise
            print(f"\nSOAK attempt 1: tritonserver aborted in its gRPC layer ({UPSTREAM_GRPC_ABORT}, upstream); "
                  f"running the soak again on a fresh server")  # fmt: skip


def _soak(srv: TritonServer) -> None:
    rng = random.Random(20261201)
    port, stub = srv.grpc_port, srv.stub_pids[0]
    for i in range(WARMUP):  # allocator and caches settle before the RSS baseline
        assert _normal(port, _params(random.Random(i))) == "ok"
    _wait_idle(srv, WARMUP)
    rss_start = h.rss_kib(stub)
    base = h.metrics(srv.metrics_port)
    jobs: list[tuple[str, int]] = []  # (kind, number of requests it sends)
    while sum(n for _, n in jobs) < NUM_REQUESTS:
        r = rng.random()
        jobs.append(("disconnect", DISCONNECT_BATCH) if r < P_DISCONNECT else ("abort", 1) if r < P_DISCONNECT + P_ABORT
                    else ("normal", 1))  # fmt: skip
    t0 = time.monotonic()

    def run(job: tuple[int, str]) -> tuple[str, str]:
        i, kind = job
        p, job_rng = _params(random.Random(i)), random.Random(i + 1)
        if kind == "normal":
            return kind, _normal(port, p)
        if kind == "abort":
            return kind, _abort(port, p, job_rng)
        return kind, _disconnect(port, p["seed"])

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(run, enumerate(kind for kind, _ in jobs)))
    wall = time.monotonic() - t0
    early = sum(1 for _, r in results if r == "early")
    bad = [(k, r) for k, r in results if r not in ("ok", "early")]
    assert not bad, f"{len(bad)} requests did not end cleanly, e.g. {bad[:3]}"
    sent = sum(n for _, n in jobs)
    m = _wait_idle(srv, h.outcome(base, "admitted") + sent - early)
    rss_end = h.rss_kib(stub)

    def delta(o: str) -> int:
        return h.outcome(m, o) - h.outcome(base, o)

    leaked = int(h.gauge(m, "mtp_kv_blocks_used"))
    preemptions = int(m[f'mtp_preemptions_total{{model="{MODEL_NAME}"}}'] -
                      base[f'mtp_preemptions_total{{model="{MODEL_NAME}"}}'])  # fmt: skip
    aborts = sum(1 for k, _ in jobs if k == "abort")
    disconnects = sum(n for k, n in jobs if k == "disconnect")
    print(f"\nSOAK requests={sent} normal={sent - aborts - disconnects} aborts={aborts} (early={early}) "
          f"disconnects={disconnects} admitted={delta('admitted')} "
          f"preemptions={preemptions} finished={delta('finished')} cancelled={delta('cancelled')} "
          f"failed={delta('failed')} rejected={delta('rejected')} leaked_blocks={leaked} "
          f"rss_start_mib={rss_start / 1024:.1f} rss_end_mib={rss_end / 1024:.1f} wall_s={wall:.1f}")  # fmt: skip
    assert sent - early <= delta("admitted") <= sent and delta("rejected") == 0, "every request reaches the engine once"
    ends = delta("finished") + delta("cancelled") + delta("failed")
    assert ends == delta("admitted"), f"{ends} ends for {delta('admitted')} admitted requests: each must end exactly once"
    assert delta("failed") == 0
    assert h.gauge(m, "mtp_requests_active") == 0 and leaked == 0, f"{leaked} KV blocks held when idle"
    assert preemptions > 0, f"NUM_BLOCKS={NUM_BLOCKS} should force preemptions; raise the load or lower it"
    assert (rss_end - rss_start) / 1024 < RSS_BOUND_MIB, f"stub RSS grew {(rss_end - rss_start) / 1024:.1f} MiB"
    assert srv.problem() is None
