"""The OpenAI frontend's adapter over the one engine loop (runtime/serving/engine_loop.py): asyncio in, asyncio out.

`submit` queues the request on the engine loop with a sink that hands each Event to an asyncio.Queue of the
calling event loop (`call_soon_threadsafe`); the HTTP handler reads that queue. Everything else (admission,
batching, cancellation, drain) is the engine loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from runtime.core.sampling import SamplingParams
from runtime.serving.engine_loop import EngineLoop, Event, NotServing, QueueFull, Sink
from runtime.serving.stats import LoopStats

__all__ = ["AsyncEngineLoop", "Event", "NotServing", "QueueFull"]


class AsyncEngineLoop:
    def __init__(self, engine: Any, max_queue: int, on_step: Callable[[LoopStats], None] | None = None) -> None:
        self.core = EngineLoop(engine, max_queue, on_step=on_step, id_prefix="oai")
        self.max_queue = max_queue

    def start(self) -> None:
        self.core.start()

    @property
    def ready(self) -> bool:
        return self.core.ready

    @property
    def thread_alive(self) -> bool:
        return self.core.thread_alive

    @property
    def num_in_flight(self) -> int:
        return self.core.num_in_flight

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Queue a request; its events arrive on the returned queue. Raises QueueFull (429) or NotServing (503)."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()  # type: ignore[var-annotated]

        def put(ev: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the HTTP event loop is already closed
                loop.call_soon_threadsafe(queue.put_nowait, ev)

        return self.core.submit(prompt_ids, params, Sink(put)), queue

    def abort(self, req_id: str) -> None:
        self.core.abort(req_id)

    def begin_drain(self, timeout_s: float) -> None:
        self.core.begin_drain(timeout_s)

    def drain(self, timeout_s: float) -> bool:
        return self.core.drain(timeout_s)
