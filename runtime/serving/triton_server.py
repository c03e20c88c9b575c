"""mtp-serve: serve an MTP engine with NVIDIA Triton Inference Server (Python backend, decoupled streaming).

    mtp-serve --engine DIR --model-repo OUT                                  # generate + serve
    mtp-serve --checkpoint models/tiny --executor torch --num-draft-tokens 2 --model-repo OUT --generate-only

Writes a model repository (`OUT/mtp/config.pbtxt`, `OUT/mtp/1/model.py`; see docs/SERVING.md), then starts
the `tritonserver` 2.51 binary shipped in the nvidia-pytriton wheel on loopback ports, waits until the
model is ready (with a timeout, failing fast on the known failure strings in the server log) and runs
until SIGTERM, SIGINT, SIGHUP or SIGUSR1, each of which drains and stops the server cleanly. The Python backend is set up without touching the
installed wheel (runtime/serving/process.py): its library, utils and the stub for this Python are copied
into a private backend directory, `nvidia_pytriton.libs` and this interpreter's libpython go on
LD_LIBRARY_PATH, and this venv's bin goes first on PATH (so the stub's interpreter finds the venv).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from string import Template

from models.tokenizer_config import TokenizerConfigError, load_tokenizer_file
from runtime.core.draft_length import parse_num_draft_tokens
from runtime.factory import EXECUTORS
from runtime.multirank.parallel import launched_by_mpi, mpi_world
from runtime.multirank.watchdog import DEFAULT_TIMEOUT_S
from runtime.serving.openai.cli_args import add_openai_args
from runtime.serving.process import MODEL_NAME, ModelLoadError, ServeError, TritonServer, free_ports, port_is_free
from runtime.serving.signals import DRAIN_SIGNALS

__all__ = ["MODEL_NAME", "ServeError", "TritonServer", "free_ports", "main", "port_is_free", "write_model_repo"]
TEMPLATE_DIR = Path(__file__).resolve().parent / "triton_model"


# ---------------------------------------------------------------------- model repository
def render_config(parameters: dict[str, str], name: str = MODEL_NAME) -> str:
    from runtime.serving.triton_model.config_template import CONFIG_TEMPLATE

    params = ",\n".join(f'  {{ key: {json.dumps(k)} value: {{ string_value: {json.dumps(str(v))} }} }}'
                        for k, v in parameters.items())  # fmt: skip
    return Template(CONFIG_TEMPLATE).substitute(name=name, parameters=params)


def write_model_repo(out: Path, *, engine: Path | None = None, checkpoint: Path | None = None,
                     executor: str | None = None, num_draft_tokens: int | None = None, max_batch: int | None = None,
                     num_blocks: int | None = None, num_state_snapshots: int | None = None,
                     state_snapshot_interval: int | None = None,
                     threads: int | None = None,
                     max_prompt_bytes: int | None = None, max_queue: int | None = None) -> Path:  # fmt: skip
    """Write OUT/mtp/{config.pbtxt, 1/model.py}; the engine options travel as config parameters."""
    if engine is None and checkpoint is None:
        raise ServeError("give --engine DIR (built by mtp-build) or --checkpoint DIR (torch executor)")
    for label, path in (("--engine", engine), ("--checkpoint", checkpoint)):
        if path is not None and not Path(path).is_dir():
            raise ServeError(f"{label} {path} is not a directory")
    try:  # the model loads it inside tritonserver, where a bad one is a traceback in its log: say it here, in one line
        load_tokenizer_file(Path(engine if engine is not None else checkpoint or ""))
    except TokenizerConfigError as e:
        raise ServeError(str(e)) from None
    executor = executor or "auto"  # the engine picks: runtime/factory.py resolve_executor
    if executor not in EXECUTORS:
        raise ServeError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    if max_prompt_bytes is not None and max_prompt_bytes < 1:
        raise ServeError(f"--max-prompt-bytes {max_prompt_bytes}: must be >= 1")
    if max_queue is not None and max_queue < 1:
        raise ServeError(f"--max-queue {max_queue}: must be >= 1")
    parameters = {
        "engine_dir": str(Path(engine).resolve()) if engine is not None else "",
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint is not None else "",
        "executor": executor,
        "num_draft_tokens": "" if num_draft_tokens is None else str(num_draft_tokens),
        "max_batch": "" if max_batch is None else str(max_batch),
        "num_blocks": "" if num_blocks is None else str(num_blocks),
        "num_state_snapshots": "" if num_state_snapshots is None else str(num_state_snapshots),
        "state_snapshot_interval": "" if state_snapshot_interval is None else str(state_snapshot_interval),
        "threads": "" if threads is None else str(threads),
        "max_prompt_bytes": "" if max_prompt_bytes is None else str(max_prompt_bytes),
        "max_queue": "" if max_queue is None else str(max_queue),
    }
    model_dir = Path(out) / MODEL_NAME
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(parameters))
    shutil.copyfile(TEMPLATE_DIR / "model.py", model_dir / "1" / "model.py")
    return Path(out)


# ---------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-serve", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", type=Path, help="engine directory built by mtp-build")
    src.add_argument("--checkpoint", type=Path, help="checkpoint directory (torch executor, no build needed)")
    p.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="default auto: an engine's compiled packages if built (else onnxruntime); torch for --checkpoint")
    p.add_argument("--num-draft-tokens", type=parse_num_draft_tokens, default=None,
                   help="K draft depths; 0 disables MTP; auto picks 0..K per step; per-request (default): 0..K per request")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--num-state-snapshots", type=int, default=None, metavar="N",
                   help="hybrid (Gated DeltaNet) models: recurrent-state snapshots kept for prefix caching "
                   "(default 4 x max batch; 0 turns their prefix caching off)")  # fmt: skip
    p.add_argument("--state-snapshot-interval", type=int, default=None, metavar="TOKENS",
                   help="hybrid (Gated DeltaNet) models: prompt tokens between two state snapshots a prefill stores "
                   "for prefix caching, a multiple of the block size (default 128; 0: only each chunk's last)")  # fmt: skip
    p.add_argument("--threads", "--torch-threads", dest="threads", type=int, default=None, metavar="N",
                   help="CPU threads of the model (torch, our kernels, ONNX Runtime); default: OMP_NUM_THREADS, else "
                   "the cores this process may use (--torch-threads: the old name)")  # fmt: skip
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="longer prompts are refused before tokenizing (default: 8 x max_seq_len)")
    p.add_argument("--frontend", choices=("triton", "openai"), default="triton",
                   help="triton: Triton Inference Server (default); openai: OpenAI-compatible HTTP (docs/SERVING.md)")
    p.add_argument("--model-repo", type=Path, default=None, help="where to write the Triton model repository")
    add_openai_args(p)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for the model to load")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT/SIGHUP/SIGUSR1: seconds in-flight streams may run before they get a final error")
    p.add_argument("--log", type=Path, default=None, help="server log file (default: OUT/tritonserver.log)")
    p.add_argument("--generate-only", action="store_true", help="write the model repository and exit")
    p.add_argument("--tp-size", type=int, default=None,
                   help="--checkpoint under mpirun (--frontend openai): tensor-parallel group size")
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="under mpirun (--frontend openai): a rank blocked this long in a collective exits (default 60)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.drain_timeout < 0:
        print(f"mtp-serve: error: --drain-timeout {args.drain_timeout:g}: must be >= 0", file=sys.stderr)
        return 2
    if not args.collective_timeout > 0:
        print(f"mtp-serve: error: --collective-timeout {args.collective_timeout:g}: must be > 0 seconds",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.frontend == "triton" and launched_by_mpi() and mpi_world()[2] > 1:
        # The model runs inside tritonserver's Python-backend stub, a process outside the MPI job: followers
        # would have no leader to replay. Every rank refuses alike; rank 0 says why.
        if mpi_world()[1] == 0:
            print("mtp-serve: error: --frontend triton cannot run under mpirun (its model runs in tritonserver's "
                  "Python-backend stub, outside the MPI job); use --frontend openai for multi-rank engines",
                  file=sys.stderr)  # fmt: skip
        return 2
    if args.frontend == "openai":
        from runtime.serving.openai.server import run

        return run(args)
    if args.model_repo is None:
        print("mtp-serve: error: --model-repo DIR is required with --frontend triton", file=sys.stderr)
        return 2
    try:
        repo = write_model_repo(args.model_repo, engine=args.engine, checkpoint=args.checkpoint,
                                executor=args.executor, num_draft_tokens=args.num_draft_tokens,
                                max_batch=args.max_batch, num_blocks=args.num_blocks,
                                num_state_snapshots=args.num_state_snapshots,
                                state_snapshot_interval=args.state_snapshot_interval,
                                threads=args.threads, max_prompt_bytes=args.max_prompt_bytes,
                                max_queue=args.max_queue)  # fmt: skip
    except ServeError as e:
        print(f"mtp-serve: error: {e}", file=sys.stderr)
        return 2
    print(f"mtp-serve: model repository written to {repo} (model {MODEL_NAME!r})", flush=True)
    if args.generate_only:
        return 0
    log = args.log or Path(args.model_repo).resolve().parent / f"{Path(args.model_repo).name}.tritonserver.log"
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port, log_path=log)
    return serve(server, args.ready_timeout, args.drain_timeout)


class _StopDuringStartup(Exception):
    pass


def serve(server: TritonServer, ready_timeout: float, drain_timeout: float) -> int:
    """Start, supervise until SIGTERM/SIGINT or a fault, then stop. 0 only after a signal and a clean exit."""
    stop_requested: list[int] = []
    ready = [False]

    def on_signal(signum, _frame):
        stop_requested.append(signum)
        if not ready[0]:  # still loading: do not wait for readiness to notice
            raise _StopDuringStartup

    old = {s: signal.signal(s, on_signal) for s in DRAIN_SIGNALS}
    code, drain, start_up_error = 1, 0.0, False
    try:
        problem = _run(server, ready_timeout, stop_requested, ready)
        if problem:
            print(f"mtp-serve: error: {problem}: stopping the server; log tail:\n{server.log_tail()}",
                  file=sys.stderr)  # fmt: skip
        else:
            code, drain = 0, drain_timeout
            print(f"mtp-serve: signal {stop_requested[0]}: draining (at most {drain_timeout:g} s), then stopping",
                  flush=True)  # fmt: skip
    except _StopDuringStartup:
        print("mtp-serve: stopped during start-up", file=sys.stderr)
    except ModelLoadError as e:  # our own start-up line (the model said why), as --frontend openai prints it
        print(f"mtp-serve: error: {e}", file=sys.stderr)
        start_up_error = True
    except ServeError as e:
        print(f"mtp-serve: error: {e}", file=sys.stderr)
    finally:
        ready[0] = True  # a second signal during the stop must not raise inside it
        rc = server.stop(drain_timeout_s=drain)
        for s, h in old.items():
            signal.signal(s, h)
    if start_up_error:
        return 2
    if server.held_after_drain:  # see TritonServer._wait_exit: nothing was lost, so this is a clean stop
        print(f"mtp-serve: stopped (every request had ended; tritonserver {server.exit_timeout_s} s after SIGTERM "
              f"still waited for its model, held by clients' open gRPC streams, so it was killed)", flush=True)
        return code
    print(f"mtp-serve: stopped (tritonserver exit code {rc})", flush=True)
    return code if rc == 0 else 1


def _run(server: TritonServer, ready_timeout: float, stop_requested: list[int], ready: list[bool]) -> str | None:
    """Start and supervise; return why the server can no longer serve, or None when a signal asked to stop."""
    proc = server.start().proc
    assert proc is not None
    seconds = server.wait_ready(ready_timeout)
    ready[0] = True
    print(f"mtp-serve: tritonserver PID {proc.pid} (stub PIDs {server.stub_pids}) ready in {seconds:.1f} s: "
          f"HTTP {server.url}, gRPC {server.host}:{server.grpc_port}, "
          f"metrics http://{server.host}:{server.metrics_port}/metrics; log {server.log_path}", flush=True)  # fmt: skip
    next_http = 0.0
    while not stop_requested:
        check_http = time.monotonic() >= next_http
        if check_http:
            next_http = time.monotonic() + 1.0
        problem = server.problem(check_http=check_http)
        if problem:
            return problem
        time.sleep(0.2)
    return None


if __name__ == "__main__":
    sys.exit(main())
