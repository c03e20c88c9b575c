"""The one engine-loop thread: it owns the LLMEngine and batches every HTTP request into its steps.

HTTP handlers (asyncio) call `submit`, which queues the request under a lock and returns an asyncio.Queue;
the thread admits queued requests between steps, runs `engine.step()`, and hands each request's outputs to
its queue with `call_soon_threadsafe`. Nothing but this thread touches the engine, so the engine needs no
locking. Admission control: at most `max_queue` requests in flight (queued + admitted); beyond that
`submit` raises QueueFull (HTTP 429). During a drain `submit` raises NotServing (HTTP 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.core.admission import RequestError
from runtime.core.sampling import SamplingParams

log = logging.getLogger("mtp.openai")


class QueueFull(Exception):
    pass


class NotServing(Exception):
    pass


@dataclass(slots=True)
class Event:
    """One step's news for one request (the queue item)."""

    new_token_ids: list[int]
    text: str  # detokenized output so far
    finished: bool
    finish_reason: str | None = None
    num_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_proposed: int | None = None  # drafts verified so far, where the engine reports it (auto K varies)
    error: str | None = None  # set: the request failed (bad request at admission, step failure, shutdown)
    bad_request: bool = False


@dataclass(slots=True)
class _Active:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    req: Any = None  # the engine's Request: its num_cached_tokens is set when it is first scheduled


class EngineLoop:
    def __init__(self, engine: Any, max_queue: int, on_step=None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step  # called on the loop thread after each step with (engine, num_pending)
        self._cv = threading.Condition()
        self._pending: list[tuple[str, list[int], SamplingParams, _Active]] = []
        self._aborts: list[str] = []
        self._active: dict[str, _Active] = {}  # loop thread only
        self._num_in_flight = 0  # pending + active, under _cv
        self._draining = False
        self._stopping = False
        self._ids = 0
        self._thread = threading.Thread(target=self._run, name="mtp-openai-engine-loop", daemon=True)

    # ------------------------------------------------------------------ called from the HTTP side
    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and not self._draining

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        act = _Active(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._draining or not self._thread.is_alive():
                raise NotServing("the server is shutting down; retry on another replica")
            if self._num_in_flight >= self.max_queue:
                raise QueueFull(f"{self._num_in_flight} requests are in flight (--max-queue {self.max_queue}); "
                                "retry later")  # fmt: skip
            self._ids += 1
            req_id = f"oai-{self._ids}"
            self._num_in_flight += 1
            self._pending.append((req_id, prompt_ids, params, act))
            self._cv.notify()
        return req_id, act.queue

    def abort(self, req_id: str) -> None:
        """Client went away: the thread aborts the request (freeing its blocks) before its next step."""
        with self._cv:
            self._aborts.append(req_id)
            self._cv.notify()

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, let in-flight ones finish for up to timeout_s, fail the rest, stop the thread.
        True when everything finished within the bound."""
        with self._cv:
            self._draining = True
            self._cv.notify()
        deadline = time.monotonic() + timeout_s
        while self._num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        clean = self._num_in_flight == 0
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=max(5.0, timeout_s))
        return clean and not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._pending or self._aborts or self._active or self._stopping):
                        self._cv.wait()
                    if self._stopping:
                        break
                    pending, self._pending = self._pending, []
                    aborts, self._aborts = self._aborts, []
                for req_id, ids, params, act in pending:  # before the aborts: one may name a pending request
                    self._admit(req_id, ids, params, act)
                for req_id in aborts:
                    self._drop(req_id, None)
                if self._active:
                    self._step()
                if self.on_step is not None:
                    self.on_step(self.engine, len(self._pending))
        finally:
            with self._cv:
                pending, self._pending = self._pending, []
            for *_, act in pending:
                self._push(act, Event([], "", True, "abort", error="the server is shutting down"))
                self._done()
            for req_id in list(self._active):
                self._drop(req_id, "the server is shutting down: the request was cut short")

    def _admit(self, req_id: str, ids: list[int], params: SamplingParams, act: _Active) -> None:
        try:
            self.engine.add_request(ids, params, req_id=req_id)
        except RequestError as e:
            self._push(act, Event([], "", True, None, error=str(e), bad_request=True))
            self._done()
            return
        act.req = self.engine.requests.get(req_id)  # kept: a request that finishes leaves engine.requests
        self._active[req_id] = act

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # keep serving: fail what was in flight, then go on
            log.exception("engine step failed")
            for req_id in list(self._active):
                self._drop(req_id, f"engine step failed: {type(e).__name__}: {e}")
            return
        for out in outputs:
            act = self._active.get(out.req_id)
            if act is None:
                continue
            cached = int(getattr(act.req, "num_cached_tokens", 0) or 0)
            self._push(act, Event(list(out.new_token_ids), out.text, out.finished, out.finish_reason, out.num_steps,
                                  list(out.accepted_per_step), cached, getattr(out, "num_proposed", None)))  # fmt: skip
            if out.finished:
                del self._active[out.req_id]
                self.engine.requests.pop(out.req_id, None)  # a long-lived server must not keep every request
                self._done()

    def _drop(self, req_id: str, error: str | None) -> None:
        act = self._active.pop(req_id, None)
        if act is None:
            return
        with contextlib.suppress(Exception):
            self.engine.abort(req_id)
        self.engine.requests.pop(req_id, None)
        if error is not None:
            self._push(act, Event([], "", True, "abort", error=error))
        self._done()

    def _done(self) -> None:
        with self._cv:
            self._num_in_flight -= 1

    @staticmethod
    def _push(act: _Active, ev: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the HTTP event loop is already closed
            act.loop.call_soon_threadsafe(act.queue.put_nowait, ev)
