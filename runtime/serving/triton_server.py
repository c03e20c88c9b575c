"""mtp-serve: serve an MTP engine with NVIDIA Triton Inference Server (Python backend, decoupled streaming).

    mtp-serve --engine DIR --model-repo OUT                                  # generate + serve
    mtp-serve --checkpoint models/tiny --executor torch --num-draft-tokens 2 --model-repo OUT --generate-only

Writes a model repository (`OUT/mtp/config.pbtxt`, `OUT/mtp/1/model.py`; see docs/SERVING.md), then starts
the `tritonserver` 2.51 binary shipped in the nvidia-pytriton wheel on loopback ports, waits until the
model is ready (with a timeout, failing fast on the known failure strings in the server log) and runs
until SIGTERM/SIGINT, which stops the server cleanly. The Python backend is set up without touching the
installed wheel (reference: TRITON_ON_CPU.md): its library, utils and the stub for this Python are copied
into a private backend directory, `nvidia_pytriton.libs` and this interpreter's libpython go on
LD_LIBRARY_PATH, and this venv's bin goes first on PATH (so the stub's interpreter finds the venv).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from string import Template

from runtime.factory import EXECUTORS

MODEL_NAME = "mtp"
REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIR = Path(__file__).resolve().parent / "triton_model"
SHM_PREFIX = "triton_python_backend_shm_region"
# Log lines that mean the server will never become ready (or is not ours): stop waiting at once.
FAILURE_STRINGS = (
    "error while loading shared libraries",  # stub cannot start: the server would hang in "loading"
    "triton_python_backend_stub is not found",
    "unable to find backend library",
    "failed to load",  # model initialize() raised, or the model config is wrong
    "error: creating server",
    "ModuleNotFoundError",
    "already in use",  # another server owns the port; its /ready would answer for us
    "is not healthy",  # stub crashed
    "failed to start",
)


class ServeError(RuntimeError):
    """The repository cannot be generated or the server did not come up; the message says why."""


# ---------------------------------------------------------------------- model repository
def render_config(parameters: dict[str, str], name: str = MODEL_NAME) -> str:
    from runtime.serving.triton_model.config_template import CONFIG_TEMPLATE

    params = ",\n".join(f'  {{ key: {json.dumps(k)} value: {{ string_value: {json.dumps(str(v))} }} }}'
                        for k, v in parameters.items())  # fmt: skip
    return Template(CONFIG_TEMPLATE).substitute(name=name, parameters=params)


def write_model_repo(out: Path, *, engine: Path | None = None, checkpoint: Path | None = None,
                     executor: str | None = None, num_draft_tokens: int | None = None, max_batch: int | None = None,
                     num_blocks: int | None = None, torch_threads: int | None = None) -> Path:  # fmt: skip
    """Write OUT/mtp/{config.pbtxt, 1/model.py}; the engine options travel as config parameters."""
    if engine is None and checkpoint is None:
        raise ServeError("give --engine DIR (built by mtp-build) or --checkpoint DIR (torch executor)")
    for label, path in (("--engine", engine), ("--checkpoint", checkpoint)):
        if path is not None and not Path(path).is_dir():
            raise ServeError(f"{label} {path} is not a directory")
    executor = executor or ("onnxruntime" if engine is not None else "torch")
    if executor not in EXECUTORS:
        raise ServeError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    parameters = {
        "repo_root": str(REPO_ROOT),
        "engine_dir": str(Path(engine).resolve()) if engine is not None else "",
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint is not None else "",
        "executor": executor,
        "num_draft_tokens": "" if num_draft_tokens is None else str(num_draft_tokens),
        "max_batch": "" if max_batch is None else str(max_batch),
        "num_blocks": "" if num_blocks is None else str(num_blocks),
        "torch_threads": "" if torch_threads is None else str(torch_threads),
    }
    model_dir = Path(out) / MODEL_NAME
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(parameters))
    shutil.copyfile(TEMPLATE_DIR / "model.py", model_dir / "1" / "model.py")
    return Path(out)


# ---------------------------------------------------------------------- the tritonserver binary
def _site_packages() -> Path:
    import pytriton

    return Path(pytriton.__file__).resolve().parents[1]


def tritonserver_dir() -> Path:
    try:
        ts = _site_packages() / "pytriton" / "tritonserver"
    except ImportError as e:
        raise ServeError(
            "nvidia-pytriton is not installed: pip install nvidia-pytriton==0.7.0 (ships tritonserver)"
        ) from e
    if not (ts / "bin" / "tritonserver").is_file():
        raise ServeError(f"no tritonserver binary under {ts}/bin")
    return ts


def prepare_backend_dir(dest: Path) -> Path:
    """A private backends/ directory: python/{libtriton_python.so, utils, stub for this Python}."""
    ts = tritonserver_dir()
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = ts / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeError(f"the nvidia-pytriton wheel has no Python-backend stub for Python {pyver} ({stub})")
    python_dir = Path(dest) / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (ts / "backends" / "python" / "libtriton_python.so",
                ts / "backends" / "python" / "triton_python_backend_utils.py", stub):  # fmt: skip
        shutil.copy2(src, python_dir / src.name)
    return Path(dest)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)  # not resolved: the venv's bin, whose python3 finds pyvenv.cfg
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(_site_packages() / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([p for p in libs if p] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env.pop("PYTHONHOME", None)
    return env


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago (the OS picks them)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in ports and port_is_free(port, host):
            ports.append(port)
    return ports


class TritonServer:
    """One tritonserver process on loopback, with its log, backend dir and shared-memory regions."""

    def __init__(self, model_repo: Path, http_port: int, grpc_port: int, metrics_port: int,
                 log_path: Path | None = None, exit_timeout_s: int = 5, host: str = "127.0.0.1") -> None:  # fmt: skip
        self.model_repo = Path(model_repo).resolve()
        self.http_port, self.grpc_port, self.metrics_port, self.host = http_port, grpc_port, metrics_port, host
        self.exit_timeout_s = exit_timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix="mtp_serve_"))
        self.log_path = Path(log_path) if log_path else self.workdir / "tritonserver.log"
        self.shm_prefix = f"{SHM_PREFIX}_mtp{uuid.uuid4().hex[:12]}"  # ours only: cleaned up by prefix
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def command(self) -> list[str]:
        backends = prepare_backend_dir(self.workdir / "backends")
        return [str(tritonserver_dir() / "bin" / "tritonserver"),
                f"--model-repository={self.model_repo}", f"--backend-directory={backends}",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                f"--exit-timeout-secs={self.exit_timeout_s}"]  # fmt: skip

    def start(self) -> TritonServer:
        busy = [p for p in (self.http_port, self.grpc_port, self.metrics_port) if not port_is_free(p, self.host)]
        if busy:
            raise ServeError(f"port(s) {busy} on {self.host} are already in use: pick other --*-port values")
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=server_env(), start_new_session=True)  # fmt: skip
        return self

    def log_tail(self, n: int = 40) -> str:
        """The error lines of the log (E-level and known failure strings), then its last n lines."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        errors = [ln for ln in lines if ln.startswith("E") or any(s in ln for s in FAILURE_STRINGS)]
        head = ["--- error lines ---", *errors[:20], "--- last lines ---"] if errors else []
        return "\n".join(head + lines[-n:])

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Seconds until the server and the model are ready; ServeError (with the log tail) otherwise."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServeError(f"tritonserver exited with code {self.proc.returncode} before it was ready; "
                                 f"log {self.log_path}:\n{self.log_tail()}")  # fmt: skip
            log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            bad = [s for s in FAILURE_STRINGS if s in log]
            if bad:
                raise ServeError(f"tritonserver log shows {bad[0]!r}; log {self.log_path}:\n{self.log_tail()}")
            ready = self._get("/v2/health/ready") == 200 and self._get(f"/v2/models/{MODEL_NAME}/ready") == 200
            if ready and self.proc.poll() is None:  # our process answered, not another server on the port
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise ServeError(f"tritonserver not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                                 f"{self.log_tail()}")  # fmt: skip
            time.sleep(0.2)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; then remove our shared-memory regions and work dir."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s if timeout_s is not None else self.exit_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
                    time.sleep(1.0)  # the stubs notice the dead parent and exit on their own
            rc = self.proc.returncode
        for path in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        if self.log_path.parent != self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return rc

    def leftover_shm(self) -> list[str]:
        return glob.glob(f"/dev/shm/{self.shm_prefix}*")


# ---------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-serve", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", type=Path, help="engine directory built by mtp-build")
    src.add_argument("--checkpoint", type=Path, help="checkpoint directory (torch executor, no build needed)")
    p.add_argument("--executor", choices=EXECUTORS, default=None, help="default: onnxruntime with --engine, else torch")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K draft depths; 0 disables MTP")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument(
        "--torch-threads", type=int, default=None, help="torch.set_num_threads in the model (torch executor)"
    )
    p.add_argument("--model-repo", type=Path, required=True, help="where to write the Triton model repository")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for the model to load")
    p.add_argument("--log", type=Path, default=None, help="server log file (default: OUT/tritonserver.log)")
    p.add_argument("--generate-only", action="store_true", help="write the model repository and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        repo = write_model_repo(args.model_repo, engine=args.engine, checkpoint=args.checkpoint,
                                executor=args.executor, num_draft_tokens=args.num_draft_tokens,
                                max_batch=args.max_batch, num_blocks=args.num_blocks,
                                torch_threads=args.torch_threads)  # fmt: skip
    except ServeError as e:
        print(f"mtp-serve: error: {e}", file=sys.stderr)
        return 2
    print(f"mtp-serve: model repository written to {repo} (model {MODEL_NAME!r})", flush=True)
    if args.generate_only:
        return 0
    log = args.log or Path(args.model_repo).resolve().parent / f"{Path(args.model_repo).name}.tritonserver.log"
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port, log_path=log)
    stop_requested: list[int] = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = server.start().proc
        assert proc is not None
        seconds = server.wait_ready(args.ready_timeout)
        print(f"mtp-serve: tritonserver PID {proc.pid} ready in {seconds:.1f} s: "
              f"HTTP {server.url}, gRPC {server.host}:{server.grpc_port}, "
              f"metrics http://{server.host}:{server.metrics_port}/metrics; log {log}", flush=True)  # fmt: skip
        while not stop_requested and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is not None and not stop_requested:
            print(f"mtp-serve: tritonserver exited with code {proc.returncode}; log tail:\n{server.log_tail()}",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    except ServeError as e:
        print(f"mtp-serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        rc = server.stop()
        if stop_requested:
            print(f"mtp-serve: stopped (tritonserver exit code {rc})", flush=True)
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
