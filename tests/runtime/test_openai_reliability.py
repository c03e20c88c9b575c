"""OpenAI-frontend faults of a hostile or careless client, on a real `mtp-serve --frontend openai` (loopback): a
client that closes mid-body, slow clients that never finish their request, and a broken tokenizer_config.json at
start-up. The behaviour both frontends share is in test_frontends.py."""

from __future__ import annotations

import json
import shutil
import socket
import time

import pytest

from runtime.serving.process import free_ports
from runtime.serving.triton_server import main
from tests.runtime.frontends import TINY, Served

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
WAIT_S = 120
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _wait_for(srv: Served, needles: tuple[str, ...], count: int, since: int) -> list[str]:
    """New server log lines (after line `since`), once `count` of them contain one of needles (or WAIT_S passed)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        lines = srv.output().splitlines()[since:]
        if sum(any(n in ln for n in needles) for ln in lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def test_client_closing_mid_body_is_one_log_line(tmp_path):
    """It used to be a 57-line ERROR traceback per connection (starlette's ClientDisconnect, unhandled)."""
    srv = Served("openai", tmp_path)
    try:
        since = len(srv.output().splitlines())
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", srv.ports[0])) as s:
                s.sendall(HEAD + b'Content-Length: 1000\r\n\r\n{"prompt": "def')
                time.sleep(0.3)  # the app is reading the body now
        lines = _wait_for(srv, ("closed the connection", "Exception in ASGI application"), 5, since)
        assert not [ln for ln in lines if "Traceback" in ln or "Exception in ASGI" in ln], "\n".join(lines)
        assert len(lines) == 5 and all("closed the connection before its request body arrived" in ln for ln in lines)
        assert srv.request("def main(", 2).error is None  # and it keeps serving
    finally:
        srv.kill_all()


def test_read_timeout_closes_slow_clients(tmp_path):
    """A client that never finishes its headers or its body is closed after --read-timeout (it used to hold its
    connection as long as it liked); a request that has arrived is never cut, however long its answer takes."""
    srv = Served("openai", tmp_path, "--read-timeout", "2")
    try:
        since = len(srv.output().splitlines())
        slow = [socket.create_connection(("127.0.0.1", srv.ports[0])) for _ in range(3)]
        slow[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        slow[1].sendall(HEAD + b'Content-Length: 1000\r\n\r\n{"prompt": "def')  # the body never finishes
        # slow[2] sends nothing at all
        for i, s in enumerate(slow):
            s.settimeout(WAIT_S)
            try:
                data = s.recv(4096)
            except TimeoutError:
                pytest.fail(f"slow client {i} still held its connection after {WAIT_S} s")
            finally:
                s.close()
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data[:80]
        body = {"prompt": "def main(", "max_tokens": 200, "temperature": 0}  # answering takes longer than 2 s
        r = srv.request(body["prompt"], body["max_tokens"], temperature=0)
        assert r.error is None and r.text
        lines = _wait_for(srv, ("closing the connection", "Traceback"), 2, since)  # the two that sent bytes
        assert not [ln for ln in lines if "Traceback" in ln], "\n".join(lines)
        assert len(lines) <= 3, "\n".join(lines)  # at most one line per slow connection
    finally:
        srv.kill_all()


@pytest.mark.parametrize(("content", "needle"), [
    ('{"chat_template": "{{ x }}",', "is not valid JSON"),
    (json.dumps({"chat_template": "{% if messages %}{{ messages[0].content }}"}), "chat_template does not compile"),
])  # fmt: skip
def test_broken_tokenizer_config_fails_start_up_in_one_line(tmp_path, capsys, content, needle):
    ckpt = tmp_path / "tiny"
    shutil.copytree(TINY, ckpt)
    (ckpt / "tokenizer_config.json").write_text(content)
    rc = main(["--frontend", "openai", "--checkpoint", str(ckpt), "--executor", "torch", "--threads", "1",
               "--port", str(free_ports(1)[0])])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and needle in err, err
    assert err.startswith("mtp-serve: error: ") and "tokenizer_config.json" in err
