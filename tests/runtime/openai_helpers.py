"""Shared by tests/runtime/test_openai_*.py: `mtp-serve --frontend openai` as a real subprocess on loopback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from runtime.serving.process import free_ports

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
START_TIMEOUT_S = 90


class OpenAIServer:
    def __init__(self, *extra: str, checkpoint: Path = TINY) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "runtime.serving.triton_server", "--frontend", "openai", "--checkpoint",
               str(checkpoint), "--executor", "torch", "--threads", "1", "--port", str(self.port), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mtp-serve exited {self.proc.returncode}:\n{self.proc.stdout.read()}")
            if self.health()[0] == 200:
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mtp-serve not ready within {START_TIMEOUT_S} s")

    def health(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise


def server_fixture(*flags: str):
    """A module-scoped `server` fixture: one OpenAI server started with `flags` for every test of the module."""

    @pytest.fixture(scope="module")
    def server():
        srv = OpenAIServer(*flags)
        yield srv
        srv.stop()

    return server


def client_fixture(timeout_s: float):
    """A module-scoped `client` fixture: the official openai client on the module's `server`, no retries."""

    @pytest.fixture(scope="module")
    def client(server):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
        yield c
        c.close()

    return client
