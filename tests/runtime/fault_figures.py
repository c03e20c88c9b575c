"""The before/after figures of docs/RELIABILITY.md's serving rows (issue 21 items 1, 2 and 5), measured on real
`mtp-serve` processes (models/tiny, torch, 1 thread). Not a test: run it against any checkout,

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.runtime.fault_figures {drain,abandon,slow}

drain:   Triton frontend, SIGTERM with six 400-token streams over Triton's HTTP generate_stream: exit code, seconds.
abandon: OpenAI frontend --max-queue 8, eight non-streaming 500-token requests whose clients reset the connection
         once generation started: tokens generated after the resets, 429s another client saw in the next 4 s.
slow:    OpenAI frontend, 20 clients that trickle a request body (1 byte / 2 s) for 60 s: server log lines, and how
         many connections the server still held when the clients gave up.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx

from tests.runtime.frontends import Served

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def drain(work: Path) -> str:
    srv = Served("triton", work)
    first, ends = threading.Event(), {}

    def run(i: int) -> None:
        body = {"text_input": "x = 1\n" * 20, "max_tokens": 400, "stream": True, "temperature": 1.0, "seed": i}
        last = ""
        try:
            with httpx.stream("POST", srv.url + "/v2/models/mtp/generate_stream", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line:
                        last = line
                        first.set()
        except httpx.HTTPError as e:
            last = f"client error {type(e).__name__}"
        ends[i] = "final" if '"finish_reason"' in last else last[:80]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    first.wait(300)
    t0 = time.monotonic()
    srv.signal(signal.SIGTERM)
    rc = srv.wait(300)
    seconds = time.monotonic() - t0
    for t in threads:
        t.join(60)
    srv.kill_all()
    return f"exit {rc} after {seconds:.1f} s; streams ended: {sorted(ends.values())}; left behind: {srv.leftovers()}"


def abandon(work: Path) -> str:
    srv = Served("openai", work, "--max-queue", "8")
    base = srv.generated_tokens()
    socks = []
    for i in range(8):
        body = json.dumps({"prompt": "def main(", "max_tokens": 500, "temperature": 1.0, "seed": i}).encode()
        s = socket.create_connection(("127.0.0.1", srv.ports[0]))
        s.sendall(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(s)
    deadline = time.monotonic() + 120
    while srv.generated_tokens() == base and time.monotonic() < deadline:
        time.sleep(0.01)
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, as a killed client
        s.close()
    at, t0, codes = srv.generated_tokens(), time.monotonic(), []
    while time.monotonic() - t0 < 4:
        codes.append(httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60).status_code)
    while srv.running() and time.monotonic() - t0 < 300:
        time.sleep(0.05)
    after = srv.generated_tokens() - at
    srv.signal(signal.SIGTERM)
    srv.wait(120)
    srv.kill_all()
    return (f"tokens generated after the 8 resets: {after} (at most 4000); another client over 4 s: "
            f"{codes.count(429)} x 429, {codes.count(200)} x 200")  # fmt: skip


def slow(work: Path) -> str:
    srv = Served("openai", work)
    since = len(srv.output().splitlines())
    socks = [socket.create_connection(("127.0.0.1", srv.ports[0])) for _ in range(20)]
    for s in socks:
        s.sendall(HEAD + b'Content-Length: 1000\r\n\r\n{"prompt": "')
    t0, held = time.monotonic(), set(range(20))
    while time.monotonic() - t0 < 60 and held:
        for i in sorted(held):
            try:
                socks[i].sendall(b"x")
            except OSError:  # the server closed it
                held.discard(i)
        time.sleep(2)
    for s in socks:
        s.close()
    time.sleep(5)
    lines = srv.output().splitlines()[since:]
    srv.signal(signal.SIGTERM)
    srv.wait(120)
    srv.kill_all()
    return (f"server log lines: {len(lines)} ({sum('Traceback' in ln for ln in lines)} tracebacks); connections "
            f"still held after 60 s: {len(held)} of 20")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("figure", choices=("drain", "abandon", "slow"))
    name = p.parse_args().figure
    with tempfile.TemporaryDirectory() as d:
        print(f"{name}: {globals()[name](Path(d))}")
