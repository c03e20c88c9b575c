"""`mtp-serve --frontend openai`: create the engine, start the engine loop, serve the app with uvicorn.

Readiness is truthful because the port is only bound after the engine loaded. SIGTERM/SIGINT: uvicorn stops
accepting, lets in-flight responses run for up to --drain-timeout s (then cancels them, which aborts their
requests), and the lifespan shutdown drains and joins the engine-loop thread. The process then exits 0
(1 if the engine loop did not stop cleanly), with no thread left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

from runtime.serving.openai.app import ServeState, create_app
from runtime.serving.openai.engine_loop import EngineLoop
from runtime.serving.openai.metrics import ServeMetrics

BYTES_PER_TOKEN_BOUND = 8  # as the Triton model: prompts are refused above 8 bytes per max_seq_len token


def load_chat_template(directory: Path | None):
    """The jinja2 `chat_template` of directory/tokenizer_config.json, or None."""
    if directory is None or not (directory / "tokenizer_config.json").is_file():
        return None
    source = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    if not isinstance(source, str):
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # the template is data: render it sandboxed

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)


def create_serving_engine(args: Any):
    """The engine of this rank. Under mpirun (a TP engine, `mpirun -np TP mtp-serve --frontend openai`) rank 0
    serves HTTP and every other rank is a follower; several DP groups would need an HTTP server per leader
    and are refused (the same on every rank, so every rank exits 2 and rank 0 prints the line)."""
    from runtime.factory import create_engine
    from runtime.multirank.parallel import EveryRankError, mpi_world

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    _, rank, world = mpi_world()
    engine = create_engine(engine_dir=args.engine, checkpoint=args.checkpoint,
                           executor=args.executor or ("onnxruntime" if args.engine else "torch"),
                           num_draft_tokens=args.num_draft_tokens, max_batch=args.max_batch,
                           num_blocks=args.num_blocks, rank=rank, world_size=world,
                           collective_timeout=getattr(args, "collective_timeout", 60.0),
                           tp_size=getattr(args, "tp_size", None), prog="mtp-serve")  # fmt: skip
    if engine.ranks.dp_size > 1:
        raise EveryRankError(f"mtp-serve serves one TP group; this engine has {engine.ranks.dp_size} data-parallel "
                             "groups: rebuild it with --world-size equal to --tp-size, or use mtp-run")  # fmt: skip
    return engine


def build_state(args: Any, engine=None) -> ServeState:
    engine = engine if engine is not None else create_serving_engine(args)
    metrics = ServeMetrics()
    max_queue = args.max_queue if args.max_queue is not None else 4 * engine.cfg.max_batch + 64
    loop = EngineLoop(engine, max_queue, on_step=metrics.engine.update)
    source = Path(args.engine or args.checkpoint)
    max_bytes = args.max_prompt_bytes or BYTES_PER_TOKEN_BOUND * engine.cfg.max_seq_len
    return ServeState(loop, metrics, engine.tokenizer, args.served_model_name or source.resolve().name,
                      engine.model_cfg.vocab_size, engine.cfg.max_seq_len, engine.k, max_bytes,
                      load_chat_template(source))  # fmt: skip


def run(args: Any) -> int:
    from runtime.core.config import ConfigError
    from runtime.multirank.parallel import EveryRankError, exit_failed_rank, mpi_world
    from runtime.multirank.strategies import lead_or_follow

    _, rank, world = mpi_world()
    try:
        engine = create_serving_engine(args)
    except EveryRankError as e:  # raised alike on every rank: all exit 2, rank 0 says why
        if rank == 0:
            print(f"mtp-serve: error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError, OSError) as e:
        if world > 1:  # this rank alone: the others wait in a start-up collective, so end the job
            exit_failed_rank(rank, e, "mtp-serve", code=2)
        print(f"mtp-serve: error: {e}", file=sys.stderr)
        return 2
    state: list[ServeState] = []

    def lead() -> int:
        try:
            state.append(build_state(args, engine))
            return _serve(args, state[0])
        finally:  # the followers are released by lead_or_follow, whatever ended the server, unless the loop
            if world > 1 and state and state[0].loop.thread_alive:  # may still step: a STOP would race it
                exit_failed_rank(rank, RuntimeError("the engine loop did not stop; ending the job"), "mtp-serve")

    return lead_or_follow(engine.ranks, lead, "mtp-serve")


def _serve(args: Any, st: ServeState) -> int:
    import uvicorn

    drained = [True]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        st.loop.start()
        yield
        drained[0] = await asyncio.to_thread(st.loop.drain, 2.0)  # uvicorn already waited for the streams

    app = create_app(st, lifespan=lifespan)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=args.drain_timeout, lifespan="on")  # fmt: skip
    server = uvicorn.Server(config)
    got: list[int] = []
    # uvicorn re-raises the signal it stopped on after its own handlers are restored; these catch it, so a
    # drained server exits 0 instead of dying of SIGTERM
    old = {s: signal.signal(s, lambda signum, _f: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    k = st.num_draft_tokens
    print(f"mtp-serve: OpenAI frontend on http://{args.host}:{args.port}/v1 (model {st.model_name!r}, K={k}, "
          f"max_queue={st.loop.max_queue})", flush=True)  # fmt: skip
    try:
        server.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not server.started:
        print(f"mtp-serve: error: could not serve on {args.host}:{args.port} (port in use?)", file=sys.stderr)
        return 1
    print(f"mtp-serve: stopped ({'drained' if drained[0] else 'engine loop did not stop cleanly'})", flush=True)
    return 0 if drained[0] else 1
