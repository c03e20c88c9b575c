"""One engine in its own process for the realistic-size format bench, so that each format's peak RSS is its own.

The bench (runtime/bench/realsize_formats.py) starts one `EngineWorker` per format and thread count: the child
sets its thread count before anything loads, loads the compiled engine, prefills the context once, and then
answers "time" requests (every step call, median of `iters` wall-clock calls each) until told to stop, when it
reports its peak resident set (getrusage ru_maxrss). The parent interleaves the workers' rounds with llama.cpp's.
With `generate` set (the hybrid bench, runtime/bench/realsize_hybrid.py), the child times whole requests through
the engine's own loop instead of step calls: a hybrid step carries GDN state that bare step calls would not manage.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

WORKER_TIMEOUT_S = 1800  # one reply (load, or a round of every call); generous: the machine is shared and loaded


def _current_rss() -> int:
    """Resident bytes now (VmRSS): beside the peak, which includes what loading needed only while it ran."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _serve(conn: Connection, engine: str, checkpoint: str, threads: int, context: int, ks: list[int],
           generate: dict | None = None) -> None:  # fmt: skip
    import json

    import torch

    torch.set_num_threads(threads)
    from models.config import ModelConfig
    from runtime.bench.realsize import step_fns, time_call

    t0 = time.perf_counter()
    if generate is not None:
        fns = request_fns(Path(engine), threads, **generate)
    else:
        from runtime.executors.compiled_executor import CompiledExecutor

        ex = CompiledExecutor(Path(engine))
        c = ModelConfig.from_hf_dict(json.loads((Path(checkpoint) / "config.json").read_text()))
        fns = step_fns(ex, c, context, ks, ex.config.kv.block_size, ex.config.kv.table_width)
    conn.send({"load_s": round(time.perf_counter() - t0, 2), "rss_after_load_bytes": _current_rss()})
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the bench left (it stopped on an error of its own and said so): nothing to report
            return
        if msg == "stop":
            conn.send({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       "rss_at_end_bytes": _current_rss()})  # fmt: skip
            return
        conn.send({name: time_call(fn, msg) for name, fn in fns.items()} if generate is None else fns["request"]())


def request_fns(engine: Path, threads: int, prompt: str, num_draft_tokens: int, max_tokens: int,
                end_id: int) -> dict[str, Callable[[], dict[str, float]]]:  # fmt: skip
    """{"request": one greedy request timed -> {"ttft", "decode" (ms per token after the first), "tokens"}}."""
    from runtime.core.sampling import SamplingParams
    from runtime.factory import create_engine

    llm = create_engine(engine, threads=threads, num_draft_tokens=num_draft_tokens, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, end_id=end_id)

    def request() -> dict[str, float]:
        t0 = time.perf_counter()
        llm.add_request(prompt, params)
        first = last = None
        n = 0
        for out in llm.stream():
            if out.new_token_ids:
                last = time.perf_counter()
                first = first or last
                n += len(out.new_token_ids)
        assert first is not None and last is not None
        return {"ttft": (first - t0) * 1e3, "decode": (last - first) * 1e3 / max(n - 1, 1), "tokens": n}

    request()  # warm-up: first-call allocations are not a round's
    return {"request": request}


class EngineWorker:
    """The parent's handle on one engine process: start (loads it), time(iters) -> ms per call, stop() -> peak RSS."""

    def __init__(
        self, engine: Path, checkpoint: Path, threads: int, context: int, ks: list[int], generate: dict | None = None
    ) -> None:
        """generate: request_fns' keyword arguments (the hybrid bench: time whole requests); None: step calls."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of the parent's torch state or memory
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, str(engine), str(checkpoint), threads, context, ks,
                                                     generate), daemon=True)  # fmt: skip
        # the child's OpenMP reads OMP_NUM_THREADS when it loads, which can be while the spawn imports the parent's
        # main module (before _serve runs), so the variable is set in the environment the child inherits
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            self.proc.start()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        loaded = self._reply(f"load {engine}")
        self.load_s, self.rss_after_load = loaded["load_s"], int(loaded["rss_after_load_bytes"])

    def _reply(self, what: str) -> dict:
        if not self.conn.poll(WORKER_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError(f"engine worker: no reply to {what} in {WORKER_TIMEOUT_S}s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"engine worker died during {what} (exit code {self.proc.exitcode}); "
                               "run the engine alone with mtp-run to see why") from None  # fmt: skip

    def time(self, iters: int) -> dict[str, float]:
        self.conn.send(iters)
        return self._reply("time")

    def stop(self) -> dict[str, int]:
        """{"peak_rss_bytes", "rss_at_end_bytes", "rss_after_load_bytes"} of the engine process, which then exits."""
        self.conn.send("stop")
        rss = self._reply("stop")
        self.proc.join(60)
        return {**rss, "rss_after_load_bytes": self.rss_after_load}
