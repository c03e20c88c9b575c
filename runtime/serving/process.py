"""One tritonserver process and everything it leaves on the machine: start, readiness, supervision, drain, stop.

Lifecycle contract (docs/SERVING.md, "Lifecycle"):
- tritonserver runs in its own process group and gets SIGKILL when the process that started it dies
  (PR_SET_PDEATHSIG); the Python-backend stub exits when tritonserver dies (the model's parent watchdog).
- `drain()` tells the model, through a file in the control directory (path in MTP_SERVE_CONTROL_DIR), to stop
  admitting and to finish or fail its in-flight streams within a bound; only then does `stop()` SIGTERM the
  server, so Triton's unload never races running streams (that race gave exit codes -11/1 and orphaned stubs).
- `stop()` kills whatever is left in the process group and removes our /dev/shm regions and work dir; the next
  start sweeps regions and work dirs whose owner PID is dead (an owner killed with SIGKILL cannot clean up).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import re
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

MODEL_NAME = "mtp"
SHM_PREFIX = "triton_python_backend_shm_region"
STUB_COMM = "triton_python_b"  # /proc/<pid>/comm of triton_python_backend_stub (truncated to 15 chars)
CONTROL_ENV = "MTP_SERVE_CONTROL_DIR"  # the model reads drain requests from here, and reports "drained"
WORKDIR_PREFIX = "mtp_serve_"
EXIT_TIMEOUT_LINE = "Exit timeout expired"  # tritonserver's log when its models did not unload in --exit-timeout-secs
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
_PR_SET_PDEATHSIG = 1


class ServeError(RuntimeError):
    """The repository cannot be generated or the server did not come up; the message says why."""


class ModelLoadError(ServeError):
    """The model's initialize() raised inside the stub (a damaged engine, no room to unpack it, ...): a start-up
    error of ours, reported as its own one line like the other frontend's, not as tritonserver's log."""


# tritonserver's line when initialize() raised: `failed to load 'mtp' version 1: Internal: EngineDirError: MESSAGE\n\nAt:
# ...` (the traceback follows, newlines escaped). MESSAGE is our one-line error.
_LOAD_ERROR = re.compile(r"failed to load '[^']+' version \d+: \w+: (?:\w+: )?(.+?)(?:\\n|\"$|$)", re.MULTILINE)


def model_load_error(log: str) -> str | None:
    """The model's own error message when its initialize() raised (from tritonserver's log), else None."""
    found = _LOAD_ERROR.search(log)
    return found.group(1).replace('\\"', '"').strip() if found else None


# ---------------------------------------------------------------------- the tritonserver binary
def _site_packages() -> Path:
    import pytriton

    return Path(pytriton.__file__).resolve().parents[1]


def tritonserver_dir() -> Path:
    try:
        ts = _site_packages() / "pytriton" / "tritonserver"
    except ImportError as e:
        raise ServeError(
            "nvidia-pytriton is not installed: pip install 'mtp-engine[serve]' (nvidia-pytriton ships tritonserver)"
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


def package_root() -> Path:
    """The directory holding the `runtime` package this process runs (a checkout or site-packages)."""
    import runtime

    return Path(runtime.__file__).resolve().parents[1]


def server_env(control_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)  # not resolved: the venv's bin, whose python3 finds pyvenv.cfg
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(_site_packages() / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([p for p in libs if p] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    # The stub must import the same `runtime` as this launcher, installed or not: no path baked into the repo.
    # Its interpreter is isolated (ignores PYTHONPATH): model.py puts this on sys.path itself.
    env["MTP_SERVE_PYTHONPATH"] = os.pathsep.join([str(package_root())] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("PYTHONHOME", None)
    if control_dir is not None:
        env[CONTROL_ENV] = str(control_dir)
    return env


# ---------------------------------------------------------------------- ports
def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on port now. SO_REUSEADDR as servers bind: TIME_WAIT left by the previous
    server on this port does not block a restart (without it, a restart was refused for about 60 s)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
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


# ---------------------------------------------------------------------- processes
def pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a dead stub stays a zombie until tritonserver reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def children(pid: int, comm_prefix: str = "") -> list[int]:
    """Live child PIDs of pid whose command name starts with comm_prefix."""
    out = []
    for stat_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            stat = Path(stat_path).read_text()
        except OSError:
            continue
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and comm.startswith(comm_prefix) and fields[0] not in ("Z", "X"):
            out.append(int(stat_path.split("/")[2]))
    return sorted(out)


def _die_with_parent_hook():
    """preexec_fn for Popen: the child gets SIGKILL when this process dies. prctl is looked up here, in the
    parent, so the child (between fork and exec, possibly beside other threads' locks) only makes the call."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody would deliver the signal
            os._exit(1)

    return hook


def sweep_stale(shm_dir: str = "/dev/shm", tmp_dir: str | None = None) -> list[str]:
    """Remove shared-memory regions and work dirs of owners that are dead (killed before they could clean)."""
    removed = []
    for path in glob.glob(f"{shm_dir}/{SHM_PREFIX}_mtp*"):
        m = re.match(rf"{SHM_PREFIX}_mtp(\d+)x", os.path.basename(path))
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    for path in glob.glob(f"{tmp_dir or tempfile.gettempdir()}/{WORKDIR_PREFIX}*"):
        m = re.match(rf"{WORKDIR_PREFIX}(\d+)_", os.path.basename(path))
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class TritonServer:
    """One tritonserver process on loopback, with its log, backend dir, control dir and shared-memory regions."""

    def __init__(self, model_repo: Path, http_port: int, grpc_port: int, metrics_port: int,
                 log_path: Path | None = None, exit_timeout_s: int = 10, host: str = "127.0.0.1") -> None:  # fmt: skip
        self.model_repo = Path(model_repo).resolve()
        self.http_port, self.grpc_port, self.metrics_port, self.host = http_port, grpc_port, metrics_port, host
        self.exit_timeout_s = exit_timeout_s
        sweep_stale()
        # The owner PID in both names lets a later start clean up after an owner that was SIGKILLed.
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}_"))
        self.control_dir = self.workdir / "control"
        self.control_dir.mkdir()
        self.log_path = Path(log_path) if log_path else self.workdir / "tritonserver.log"
        self.shm_prefix = f"{SHM_PREFIX}_mtp{os.getpid()}x{uuid.uuid4().hex[:8]}"  # ours only: cleaned by prefix
        self.proc: subprocess.Popen | None = None
        self.stub_pids: list[int] = []
        self.held_after_drain = False  # stop(): killed after a finished drain (see _wait_exit)

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
                                         env=server_env(self.control_dir), start_new_session=True,
                                         preexec_fn=_die_with_parent_hook())  # fmt: skip
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

    def ready(self) -> bool:
        return self._get("/v2/health/ready") == 200 and self._get(f"/v2/models/{MODEL_NAME}/ready") == 200

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Seconds until the server and the model are ready; ServeError (with the log tail) otherwise."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServeError(f"tritonserver exited with code {self.proc.returncode} before it was ready; "
                                 f"log {self.log_path}:\n{self.log_tail()}")  # fmt: skip
            log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            if message := model_load_error(log):
                raise ModelLoadError(message)
            bad = [s for s in FAILURE_STRINGS if s in log]
            if bad:
                raise ServeError(f"tritonserver log shows {bad[0]!r}; log {self.log_path}:\n{self.log_tail()}")
            if self.ready() and self.proc.poll() is None:  # our process answered, not another server on the port
                self.stub_pids = children(self.proc.pid, STUB_COMM)
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise ServeError(f"tritonserver not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                                 f"{self.log_tail()}")  # fmt: skip
            time.sleep(0.2)

    def problem(self, check_http: bool = True) -> str | None:
        """Why the server can no longer serve (None: healthy). Triton keeps answering ready with a dead stub,
        so the stub PIDs seen at readiness are watched directly; the model's ready endpoint covers unloads."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            return f"tritonserver exited with code {self.proc.returncode}"
        dead = [p for p in self.stub_pids if not pid_alive(p)]
        if dead:
            return f"the Python-backend stub (PID {dead[0]}) died; every request would fail"
        if check_http and self._get(f"/v2/models/{MODEL_NAME}/ready") not in (200, 0):
            return f"model {MODEL_NAME!r} is no longer ready"
        return None

    def drain(self, timeout_s: float) -> bool:
        """Ask the model to stop admitting and to end its streams within timeout_s; True once it says so."""
        if self.proc is None or self.proc.poll() is not None or any(not pid_alive(p) for p in self.stub_pids):
            return False
        tmp = self.control_dir / "drain.tmp"
        tmp.write_text(json.dumps({"timeout_s": timeout_s}))
        tmp.replace(self.control_dir / "drain")  # atomic: the model never reads half a file
        deadline = time.monotonic() + timeout_s + 5.0  # the model fails what is left at timeout_s
        while time.monotonic() < deadline:
            if (self.control_dir / "drained").exists():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def stop(self, timeout_s: float | None = None, drain_timeout_s: float = 0.0) -> int | None:
        """Drain (if asked), SIGTERM, wait, SIGKILL if needed; then kill what is left in the process group and
        remove our shared-memory regions and work dir."""
        rc = None
        self.held_after_drain = False
        if self.proc is not None:
            if self.proc.poll() is None:
                drained = self.drain(drain_timeout_s)
                self.proc.send_signal(signal.SIGTERM)
                self.held_after_drain = self._wait_exit(timeout_s or self.exit_timeout_s + 15.0, drained)
            rc = self.proc.returncode
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is empty after a clean stop
                os.killpg(self.proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while any(pid_alive(p) for p in self.stub_pids) and time.monotonic() < deadline:
                time.sleep(0.05)
        for path in self.leftover_shm():
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        shutil.rmtree(self.control_dir, ignore_errors=True)
        if self.log_path.parent != self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return rc

    def _wait_exit(self, timeout_s: float, drained: bool) -> bool:
        """Wait for tritonserver to exit after SIGTERM; SIGKILL it past timeout_s. True when it was killed although
        the drain had ended every request: Triton 2.51 then waits for its model to unload, which never happens
        while a client holds an idle gRPC stream open (its gRPC frontend has no shutdown deadline before Triton
        2.55); its own --exit-timeout-secs expires and it still does not exit. That case is killed 2 s after
        its log says so instead of at timeout_s: nothing is lost, every request already had its last response."""
        deadline, held = time.monotonic() + timeout_s, False
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            if drained and not held and EXIT_TIMEOUT_LINE in self._log_text():
                held, deadline = True, min(deadline, time.monotonic() + 2.0)
            time.sleep(0.1)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return held
        return False

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def leftover_shm(self) -> list[str]:
        return glob.glob(f"/dev/shm/{self.shm_prefix}*")
