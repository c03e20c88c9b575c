"""Both serving frontends behind one harness, for the tests that pin the behaviour they must share
(tests/runtime/test_frontends.py): `mtp-serve` as a real subprocess on loopback (the CLI, its signals and children),
models/tiny with the torch executor, K=2, one thread; the Triton frontend driven over gRPC, the OpenAI one over
HTTP. Server output goes to a file (a pipe nobody reads could fill and block the server)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx

from runtime.serving.process import SHM_PREFIX, WORKDIR_PREFIX, children, free_ports, pid_alive
from tests.runtime import serve_helpers as h

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
FRONTENDS = ("triton", "openai")
START_TIMEOUT_S = 180  # a loaded 2-core machine; never a timing assertion


@dataclass
class Result:
    ended: bool  # the request's end arrived: Triton's FINAL response, the OpenAI `data: [DONE]` / a whole JSON body
    error: str | None  # the error the server sent (None: none)
    text: str = ""
    status: int = 200  # HTTP status (OpenAI); 200 for Triton


class Served:
    """One `mtp-serve --frontend FRONTEND` process."""

    def __init__(self, frontend: str, workdir: Path, *extra: str) -> None:
        self.frontend = frontend
        self.ports = free_ports(3)
        self.out_path = workdir / f"mtp-serve-{frontend}-{self.ports[0]}.out"
        cmd = [sys.executable, "-m", "runtime.serving.triton_server", "--frontend", frontend, "--checkpoint",
               str(TINY), "--executor", "torch", "--num-draft-tokens", "2", "--threads", "1"]  # fmt: skip
        if frontend == "triton":
            cmd += ["--model-repo", str(workdir / f"repo-{self.ports[0]}"), "--http-port", str(self.ports[0]),
                    "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2]),
                    "--ready-timeout", str(START_TIMEOUT_S)]  # fmt: skip
        else:
            cmd += ["--port", str(self.ports[0])]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.out = open(self.out_path, "wb")  # noqa: SIM115 - closed in wait()/kill_all()
        self.proc = subprocess.Popen([*cmd, *extra], stdout=self.out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        self.server_pid, self.stub_pids = 0, []
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        self._wait_ready()

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"mtp-serve exited with {self.proc.returncode}:\n{self.output()}")
            if self.frontend == "triton":
                m = re.search(r"tritonserver PID (\d+) \(stub PIDs \[([\d, ]*)\]\) ready", self.output())
                if m:
                    self.server_pid = int(m.group(1))
                    self.stub_pids = [int(p) for p in m.group(2).split(",") if p.strip()]
                    return
            elif self._get("/health") == 200:
                return
            time.sleep(0.2)
        self.kill_all()
        raise AssertionError(f"mtp-serve not ready after {START_TIMEOUT_S} s:\n{self.output()}")

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    # ------------------------------------------------------------------ requests
    def stream(self, prompt: str, max_tokens: int, on_first=None, **sampling) -> Result:
        """One streaming request to its end (or its error)."""
        if self.frontend == "triton":
            responses, error = h.generate(self.ports[1], prompt, max_tokens, True, on_response=on_first,
                                          **_triton(sampling))  # fmt: skip
            return Result(any(h.is_final(r) for r in responses), error, h.text_of(responses))
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **_openai(sampling)}
        lines: list[str] = []
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=h.RESPONSE_TIMEOUT_S) as r:
            if r.status_code != 200:
                r.read()
                return Result(True, r.json()["error"]["message"], status=r.status_code)
            with contextlib.suppress(httpx.HTTPError):  # a stream cut by the server is what some tests look for
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if on_first is not None and len(lines) == 1:
                            on_first(line)
        error = next((json.loads(ln[6:])["error"]["message"] for ln in lines if ln.startswith('data: {"error"')), None)
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines
                       if ln.startswith("data: {") and json.loads(ln[6:]).get("choices"))  # fmt: skip
        return Result(bool(lines) and lines[-1] == "data: [DONE]", error, text)

    def request(self, prompt: str, max_tokens: int, **sampling) -> Result:
        """One non-streaming request."""
        if self.frontend == "triton":
            responses, error = h.generate(self.ports[1], prompt, max_tokens, False, **_triton(sampling))
            return Result(any(h.is_final(r) for r in responses), error, h.text_of(responses))
        body = {"prompt": prompt, "max_tokens": max_tokens, **_openai(sampling)}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=h.RESPONSE_TIMEOUT_S)
        if r.status_code != 200:
            return Result(True, r.json()["error"]["message"], status=r.status_code)
        return Result(True, None, r.json()["choices"][0]["text"])

    def generated_tokens(self) -> int:
        """Output tokens the engine generated so far (also those of requests nobody reads any more)."""
        if self.frontend == "triton":
            return int(h.metrics(self.ports[2]).get('mtp_generated_tokens_total{model="mtp"}', 0))
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            m = re.search(r"^mtp_engine_generated_tokens_total (\S+)$", r.read().decode(), re.M)
        return int(float(m.group(1))) if m else 0

    def running(self) -> int:
        """Requests the engine loop is still serving."""
        if self.frontend == "triton":
            return int(h.metrics(self.ports[2]).get('mtp_requests_active{model="mtp"}', 0))
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return int(json.loads(r.read())["in_flight"])

    # ------------------------------------------------------------------ lifecycle
    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.out.close()

    def leftovers(self) -> list[str]:
        """What this server left behind once stopped: processes, shm regions, work dirs."""
        pid = self.proc.pid
        left = [f"PID {p}" for p in [self.server_pid, *self.stub_pids, *children(pid)] if p and pid_alive(p)]
        left += glob.glob(f"/dev/shm/{SHM_PREFIX}_mtp{pid}x*")
        return left + glob.glob(f"{tempfile.gettempdir()}/{WORKDIR_PREFIX}{pid}_*")

    def kill_all(self) -> None:
        h.kill_all(self)


def _triton(sampling: dict) -> dict:
    return {("stop_words" if k == "stop" else k): v for k, v in sampling.items()}


def _openai(sampling: dict) -> dict:
    return dict(sampling)
