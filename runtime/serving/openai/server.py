"""`mtp-serve --frontend openai`: create the engine, start the engine loop, serve the app with uvicorn.

Readiness is truthful because the port is only bound after the engine loaded. SIGTERM, SIGINT, SIGHUP (a closed
terminal) and SIGUSR1 all drain (runtime/serving/signals.py): uvicorn stops accepting, lets in-flight responses
run for up to --drain-timeout s (then cancels them, which aborts their requests), and the lifespan shutdown
drains and joins the engine-loop thread. The process then exits 0 (1 if the engine loop did not stop cleanly),
with no thread left running. A connection whose request has not arrived within --read-timeout s is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

from models.tokenizer_config import TokenizerConfigError, load_chat_template
from runtime.serving.limits import default_max_queue, prompt_byte_limit
from runtime.serving.openai.app import ServeState, create_app
from runtime.serving.openai.body import DEFAULT_READ_TIMEOUT_S, read_timeout_protocol
from runtime.serving.openai.engine_loop import AsyncEngineLoop
from runtime.serving.openai.metrics import ServeMetrics
from runtime.serving.openai.structured import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S, Structured
from runtime.serving.signals import DRAIN_SIGNALS

GRACE_S = 5.0  # uvicorn's graceful-shutdown bound is --drain-timeout plus this: the engine loop cuts first


def create_serving_engine(args: Any):
    """The engine of this rank. Under mpirun (a TP engine, `mpirun -np TP mtp-serve --frontend openai`) rank 0
    serves HTTP and every other rank is a follower; several DP groups would need an HTTP server per leader
    and are refused (the same on every rank, so every rank exits 2 and rank 0 prints the line)."""
    from runtime.factory import create_engine, use_threads
    from runtime.multirank.parallel import EveryRankError, mpi_world

    threads = use_threads(args.threads)
    _, rank, world = mpi_world()
    engine = create_engine(engine_dir=args.engine, checkpoint=args.checkpoint, threads=threads,
                           executor=args.executor or "auto",
                           num_draft_tokens=args.num_draft_tokens, max_batch=args.max_batch,
                           num_blocks=args.num_blocks, num_state_snapshots=getattr(args, "num_state_snapshots", None),
                           state_snapshot_interval=getattr(args, "state_snapshot_interval", None),
                           rank=rank, world_size=world,
                           collective_timeout=getattr(args, "collective_timeout", 60.0),
                           tp_size=getattr(args, "tp_size", None), prog="mtp-serve")  # fmt: skip
    if engine.ranks.dp_size > 1:
        raise EveryRankError(f"mtp-serve serves one TP group; this engine has {engine.ranks.dp_size} data-parallel "
                             "groups: rebuild it with --world-size equal to --tp-size, or use mtp-run")  # fmt: skip
    from runtime.core.self_check import start_up_check

    start_up_check(engine, getattr(args, "acceptance_check", "warn"), "mtp-serve")  # before the port opens
    return engine


def grammar_settings(args: Any) -> tuple[int, int, float]:
    """(cache bytes, largest constraint in bytes, compile timeout s) from the --grammar-* flags; ConfigError (one
    line) for a value that is not > 0. mtp-serve checks them before the engine loads (seconds)."""
    from runtime.core.config import ConfigError

    cache_mb = int(getattr(args, "grammar_cache_mb", 512))
    max_bytes = int(getattr(args, "grammar_max_bytes", DEFAULT_MAX_BYTES))
    timeout_s = float(getattr(args, "grammar_compile_timeout", DEFAULT_TIMEOUT_S))
    for flag, value in (("--grammar-cache-mb", cache_mb), ("--grammar-max-bytes", max_bytes),
                        ("--grammar-compile-timeout", timeout_s)):  # fmt: skip
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value:g}")
    return cache_mb << 20, max_bytes, timeout_s


def build_state(args: Any, engine=None) -> ServeState:
    grammar = grammar_settings(args)
    engine = engine if engine is not None else create_serving_engine(args)
    metrics = ServeMetrics()
    max_queue = args.max_queue if args.max_queue is not None else default_max_queue(engine.cfg.max_batch)
    loop = AsyncEngineLoop(engine, max_queue, on_step=metrics.engine.update)
    source = Path(args.engine or args.checkpoint)
    max_bytes = prompt_byte_limit(engine.cfg.max_seq_len, args.max_prompt_bytes)
    structured = None
    if engine.tokenizer is not None:
        structured = Structured(engine.tokenizer, engine.model_cfg.vocab_size, list(engine.model_cfg.eos_token_id),
                                *grammar)  # fmt: skip
    return ServeState(loop, metrics, engine.tokenizer, args.served_model_name or source.resolve().name,
                      engine.model_cfg.vocab_size, engine.cfg.max_seq_len, engine.k, max_bytes,
                      load_chat_template(source), structured,
                      getattr(args, "per_request_spec_decode_metrics", None) or "off")  # fmt: skip


def run(args: Any) -> int:
    from runtime.core.config import ConfigError
    from runtime.multirank.parallel import EveryRankError, exit_failed_rank, mpi_world
    from runtime.multirank.strategies import lead_or_follow

    _, rank, world = mpi_world()
    try:
        grammar_settings(args)
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
            try:
                state.append(build_state(args, engine))
            except TokenizerConfigError as e:  # a broken tokenizer_config.json: one line, never a traceback
                print(f"mtp-serve: error: {e}", file=sys.stderr)
                return 2
            return _serve(args, state[0])
        finally:  # lead_or_follow releases the followers, whatever ended the server, unless the loop may still
            if world > 1 and state and state[0].loop.thread_alive:  # step: a STOP would race its broadcasts
                exit_failed_rank(rank, RuntimeError("the engine loop did not stop; ending the job"), "mtp-serve")

    return lead_or_follow(engine.ranks, lead, "mtp-serve")


def _serve(args: Any, st: ServeState) -> int:
    import uvicorn

    drained = [True]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        st.loop.start()
        yield
        drained[0] = await asyncio.to_thread(st.loop.drain, args.drain_timeout)  # already cut at the deadline

    class DrainingServer(uvicorn.Server):
        """On a terminating signal the engine loop starts its bounded drain at once: requests still running at
        --drain-timeout end with an error event (a stream then still gets `data: [DONE]`) before uvicorn's own
        graceful-shutdown bound (a little longer) would cancel their responses mid-stream."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            st.loop.begin_drain(args.drain_timeout)
            super().handle_exit(sig, frame)

    app = create_app(st, lifespan=lifespan)
    read_timeout = getattr(args, "read_timeout", None) or DEFAULT_READ_TIMEOUT_S
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=args.drain_timeout + GRACE_S, lifespan="on",
                            http=read_timeout_protocol(read_timeout))  # fmt: skip
    server = DrainingServer(config)
    # uvicorn installs handle_exit for SIGTERM/SIGINT while it runs and re-raises the signal it stopped on once
    # it restored the handlers found before run(): handle_exit again (a no-op now), so a drained server exits 0
    # instead of dying of SIGTERM. SIGHUP (a closed terminal) and SIGUSR1 drain the same way.
    old = {s: signal.signal(s, server.handle_exit) for s in DRAIN_SIGNALS}
    k = st.num_draft_tokens
    print(f"mtp-serve: OpenAI frontend on http://{args.host}:{args.port}/v1 (model {st.model_name!r}, executor "
          f"{st.loop.core.engine.executor_name}, K={k}, max_queue={st.loop.max_queue})", flush=True)  # fmt: skip
    try:
        server.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not server.started:
        print(f"mtp-serve: error: could not serve on {args.host}:{args.port} (port in use?)", file=sys.stderr)
        return 1
    if st.loop.thread_alive:
        print("mtp-serve: stopped (engine loop did not stop cleanly)", flush=True)
        return 1
    how = "drained" if drained[0] else f"drained; requests still running after {args.drain_timeout:g} s were cut short"
    print(f"mtp-serve: stopped ({how})", flush=True)
    return 0
