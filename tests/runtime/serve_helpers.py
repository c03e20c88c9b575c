"""Shared by the tests/runtime/test_serve*.py files: a gRPC streaming client, the server's /metrics, and
`mtp-serve` run as a real subprocess (the CLI, its signals and its children)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from runtime.serving.process import STUB_COMM, children, pid_alive
from runtime.serving.triton_server import MODEL_NAME, TritonServer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
RESPONSE_TIMEOUT_S = 60
TYPES = {"temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "seed": "INT64", "end_id": "INT32",
         "stop_words": "BYTES"}  # fmt: skip


class AllStarted(threading.Event):
    """Set once each of n streams has its first response (`began(i)` from each stream's callback). A signal sent
    earlier would race a thread still connecting, whose refusal is the server stopping, not a failed drain."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.started, self.lock = n, set[int](), threading.Lock()

    def began(self, i: int) -> None:
        with self.lock:
            self.started.add(i)
            if len(self.started) == self.n:
                self.set()


def make_input(name: str, value, dtype: str):
    arr = np.array(value if isinstance(value, list) else [value])
    if dtype == "BYTES":
        arr = np.array([v.encode() if isinstance(v, str) else v for v in arr.tolist()], dtype=np.object_)
    else:
        arr = arr.astype({"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}[dtype])
    tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
    tensor.set_data_from_numpy(arr)
    return tensor


def request_inputs(prompt, max_tokens: int, stream: bool = True, **extra) -> list:
    inputs = [make_input("text_input", prompt, "BYTES"), make_input("max_tokens", max_tokens, "INT32"),
              make_input("stream", stream, "BOOL")]  # fmt: skip
    return inputs + [make_input(name, value, TYPES[name]) for name, value in extra.items()]


def is_final(result) -> bool:
    final = result.get_response().parameters.get("triton_final_response")
    return final is not None and final.bool_param


def generate(grpc_port: int, prompt, max_tokens: int, stream: bool = True, on_response=None, **extra):
    """One request on its own gRPC stream; returns (responses, error message or None)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    responses, error = [], None
    try:
        client.async_stream_infer(MODEL_NAME, request_inputs(prompt, max_tokens, stream, **extra),
                                  enable_empty_final_response=True)  # fmt: skip
        while True:
            result, err = results.get(timeout=RESPONSE_TIMEOUT_S)
            if err is not None:
                error = str(err)
                break
            responses.append(result)
            if on_response is not None:
                on_response(result)
            if is_final(result):
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, error


def ids_of(responses) -> list[int]:
    return [int(t) for r in responses if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids")]


def text_of(responses) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in responses if r.as_numpy("text_output") is not None)


def metrics(port: int) -> dict[str, float]:
    """The mtp_* series of /metrics: {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(mtp_\S+)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def outcome(values: dict[str, float], name: str) -> int:
    return int(values.get(f'mtp_requests_total{{model="{MODEL_NAME}",outcome="{name}"}}', 0))


def gauge(values: dict[str, float], name: str) -> float:
    return values[f'{name}{{model="{MODEL_NAME}"}}']


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for PID {pid}")


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (tritonserver's group holds it and its stubs)."""
    out = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(stat_path.parent.name))
    return out


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


class MtpServe:
    """`python -m runtime.serving.triton_server ...` as a subprocess: the real CLI, signals and children."""

    def __init__(self, repo_dir: Path, ports: list[int], *extra: str, checkpoint: Path = TINY,
                 pythonpath: Path | None = ROOT, python: Path | None = None) -> None:  # fmt: skip
        self.ports = ports
        self.out_path = repo_dir.parent / f"{repo_dir.name}.mtp-serve.out"
        cmd = [str(python or sys.executable), "-m", "runtime.serving.triton_server", "--checkpoint", str(checkpoint),
               "--num-draft-tokens", "2", "--threads", "1", "--model-repo", str(repo_dir),
               "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
               "--ready-timeout", "90", *extra]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        self.out = open(self.out_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env, cwd=repo_dir.parent)
        self.server_pid = 0
        self.stub_pids: list[int] = []

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(r"tritonserver PID (\d+) \(stub PIDs \[([\d, ]*)\]\) ready", self.output())
            if m:
                self.server_pid = int(m.group(1))
                self.stub_pids = [int(p) for p in m.group(2).split(",") if p.strip()]
                assert self.stub_pids == children(self.server_pid, STUB_COMM)
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"mtp-serve exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.2)
        raise AssertionError(f"mtp-serve not ready after {timeout_s} s:\n{self.output()}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.out.close()

    def kill_all(self) -> None:
        kill_all(self)


def kill_all(srv) -> None:
    """Test teardown of a served stack (MtpServe, tests/runtime/frontends.py Served): nothing of ours may outlive
    the test, whatever it asserted."""
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(10)
    srv.out.close()
    for pid in [srv.server_pid, *srv.stub_pids]:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def leftovers(srv: TritonServer) -> list[str]:
    """What a stopped TritonServer left behind: processes, shm regions, its work dir."""
    left = [f"PID {p}" for p in srv.stub_pids if pid_alive(p)] + srv.leftover_shm()
    if srv.workdir.exists():
        left.append(str(srv.workdir))
    return left
