"""The one engine loop behind every serving frontend: a thread that owns the LLMEngine and batches every
request into its steps.

Frontends are thin adapters (triton_model/model.py, openai/engine_loop.py): they parse and tokenize a request
on their own threads, then `submit` it with a `Sink`, the request's way out. The thread admits queued requests
between steps, runs `engine.step()`, and hands each request's news to its sink as an `Event`; every admitted
request gets exactly one final event (finished, cancelled, or an error). Nothing but this thread touches the
engine, so the engine needs no locking.

- Admission: at most `max_queue` requests in flight (queued + admitted): `submit` raises QueueFull beyond that,
  and NotServing once a drain began. The engine's own checks run at admission; a bad request gets one final
  event with `bad_request` set and changes nothing for the others.
- Cancellation: `abort(req_id)` from any thread, or the sink's `cancelled()` poll (once per iteration); the
  request's KV blocks are freed before the next step.
- Drain: `begin_drain(t)` refuses new requests and lets admitted ones run for t seconds, then cuts them short
  with an error; `drain(t)` also waits for that and stops the thread. `stop()` fails whatever is left.
- Metrics: `on_step(LoopStats)` after each step before its events go out, and at the end of each iteration
  (runtime/serving/stats.py): the frontends' one source.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.core.admission import RequestError
from runtime.core.request import RequestOutput
from runtime.core.sampling import SamplingParams
from runtime.serving.stats import Counts, LoopStats, take

_log = logging.getLogger("mtp.serving")
DRAINING = "the server is shutting down (draining): send the request to another server"


class QueueFull(Exception):
    pass


class NotServing(Exception):
    pass


@dataclass(slots=True)
class Event:
    """One iteration's news for one request."""

    new_token_ids: list[int]
    text: str  # detokenized output so far
    finished: bool
    finish_reason: str | None = None  # "abort" without an error: the client cancelled it
    num_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_proposed: int | None = None  # drafts verified so far (auto K varies per step)
    error: str | None = None  # set: the request failed (bad request at admission, the engine aborted it, shutdown)
    bad_request: bool = False
    output_ids: list[int] | None = None  # every generated id: on the final event of a finished request only
    new_logprobs: list = field(default_factory=list)  # TokenLogprob per new token (when asked for)
    prompt_logprobs: list = field(default_factory=list)  # None, then TokenLogprob per prompt token (echo)

    @classmethod
    def of(cls, out: RequestOutput) -> Event:
        lps = out.logprobs
        # finish_reason "error": the engine aborted this request alone (a grammar that refused the sampled token,
        # non-finite logits, ...): its reason goes to the client as an error, never as a clean "stop"
        return cls(list(out.new_token_ids), out.text, out.finished, out.finish_reason, out.num_steps,
                   list(out.accepted_per_step), out.num_cached_tokens, out.num_proposed,
                   error=out.error if out.finish_reason == "error" else None,
                   output_ids=out.output_ids if out.finished else None,
                   new_logprobs=lps[len(lps) - len(out.new_token_ids) :] if lps else [],
                   prompt_logprobs=out.prompt_logprobs)  # fmt: skip


@dataclass(slots=True)
class Sink:
    """Where a request's events go. Both callables run on the loop thread and must not block."""

    put: Callable[[Event], None]
    cancelled: Callable[[], bool] | None = None  # polled once per iteration: True aborts the request


def _default_log(level: str, msg: str) -> None:
    _log.log(logging.ERROR if level == "error" else logging.WARNING, msg)


class EngineLoop:
    def __init__(self, engine: Any, max_queue: int, on_step: Callable[[LoopStats], None] | None = None,
                 log: Callable[[str, str], None] = _default_log, id_prefix: str = "req") -> None:  # fmt: skip
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step
        self.log = log
        self.counts = Counts()  # loop thread, except "rejected" (under _cv)
        self._id_prefix = id_prefix
        self._cv = threading.Condition()
        self._pending: list[tuple[str, str | list[int], SamplingParams, Sink]] = []  # under _cv
        self._aborts: list[str] = []  # under _cv
        self._active: dict[str, Sink] = {}  # loop thread only
        self._num_in_flight = 0  # pending + active, under _cv
        self._deadline: float | None = None  # under _cv: set when a drain began; admitted requests are cut then
        self._drain_timeout = 0.0
        self._num_cut = 0  # requests a drain or stop cut short
        self._stopping = False
        self._ids = 0
        self._thread = threading.Thread(target=self._run, name="mtp-engine-loop", daemon=True)
        ranks = getattr(engine, "ranks", None)  # a multi-rank leader: its watchdog's line reaches the clients
        if ranks is not None:
            ranks.on_collective_timeout(self._last_words)

    # ------------------------------------------------------------------ called from the frontends
    def start(self) -> None:
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and not self.draining

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def submit(self, prompt: str | list[int], params: SamplingParams, sink: Sink) -> str:
        """Queue a request; its events go to sink. Raises NotServing (draining or stopped) or QueueFull."""
        with self._cv:
            if self._deadline is not None or self._stopping or not self._thread.is_alive():
                self.counts.add("rejected")
                raise NotServing(DRAINING)
            if self._num_in_flight >= self.max_queue:
                self.counts.add("rejected")
                raise QueueFull(f"{self._num_in_flight} requests are in flight (--max-queue {self.max_queue}); "
                                "retry later")  # fmt: skip
            self._ids += 1
            req_id = f"{self._id_prefix}-{self._ids}"
            self._num_in_flight += 1
            self._pending.append((req_id, prompt, params, sink))
            self._cv.notify()
        return req_id

    def reject(self) -> None:
        """Count a request the frontend refused before submitting it (bad input)."""
        with self._cv:
            self.counts.add("rejected")

    def abort(self, req_id: str) -> None:
        """The client went away: the thread aborts the request (freeing its blocks) before its next step."""
        with self._cv:
            self._aborts.append(req_id)
            self._cv.notify()

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests; admitted ones may run for timeout_s more, then get an error."""
        with self._cv:
            if self._deadline is None:
                self._drain_timeout = timeout_s
                self._deadline = time.monotonic() + timeout_s
                self._cv.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._num_in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        return self._num_in_flight == 0

    def drain(self, timeout_s: float) -> bool:
        """begin_drain, wait until every request ended (the thread cuts what is left at timeout_s), stop.
        True when everything finished by itself within the bound and the thread stopped."""
        self.begin_drain(timeout_s)
        self.wait_idle(timeout_s + 5.0)  # the cut happens between steps: allow one step past the deadline
        return self.stop(max(5.0, timeout_s)) and self._num_cut == 0

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the thread; whatever is still queued or running gets an error. True once the thread ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

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
                    deadline = self._deadline
                for req_id, prompt, params, sink in pending:  # before the aborts: one may name a pending request
                    self._admit(req_id, prompt, params, sink)
                for req_id in aborts:
                    self._drop(req_id, "cancelled", None)
                self._drop_cancelled()
                if deadline is not None and self._active and time.monotonic() >= deadline:
                    self._fail_all(f"the server is shutting down: the request was cut short after the "
                                   f"{self._drain_timeout:g} s drain timeout", cut=True)  # fmt: skip
                if self._active and not self.engine.has_unfinished():  # cannot happen; never spin on it
                    self._fail_all("internal error: the engine lost the request")
                if self._active:
                    self._step()  # reports the stats before any client hears of the step, too
                self._report()  # the iteration's end state: outcome counts included
        finally:
            with self._cv:
                pending, self._pending = self._pending, []
            for req_id, _prompt, _params, sink in pending:
                self._active[req_id] = sink  # failed below with the admitted ones
            self._fail_all("the server is shutting down: the request was cut short", cut=True)
            self._report()

    def _admit(self, req_id: str, prompt: str | list[int], params: SamplingParams, sink: Sink) -> None:
        try:
            self.engine.add_request(prompt, params, req_id=req_id)
        except RequestError as e:
            self._final(sink, Event([], "", True, None, error=str(e), bad_request=True), "rejected")
            return
        except Exception as e:
            self.log("error", f"add_request failed: {traceback.format_exc()}")
            self._final(sink, Event([], "", True, None, error=f"cannot add the request: {type(e).__name__}: {e}"),
                        "rejected")  # fmt: skip
            return
        self.counts.add("admitted")
        self._active[req_id] = sink

    def _last_words(self, line: str) -> None:
        """The collective watchdog fired (its thread; the loop thread is blocked in a collective and the rank is
        leaving): every request in flight, admitted or pending, ends with the watchdog's line as its error instead
        of a bare disconnect. Only hands events to the frontends (Sink.put does not block)."""
        error = line.split(": error: ", 1)[-1]
        sinks = list(self._active.values())
        if self._cv.acquire(timeout=0.2):  # pending requests; never wait on a lock the blocked thread holds
            try:
                sinks += [sink for *_, sink in self._pending]
            finally:
                self._cv.release()
        for sink in sinks:  # "error": the engine failed them (HTTP 500), not a drain's cut (503)
            self._put(sink, Event([], "", True, "error", error=error))

    def _drop_cancelled(self) -> None:
        for req_id, sink in list(self._active.items()):
            if sink.cancelled is not None and sink.cancelled():
                self._drop(req_id, "cancelled", None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # keep serving: fail what was in flight, then go on
            self.log("error", f"engine step failed: {traceback.format_exc()}")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            return
        # first: a client that heard of this step and scrapes /metrics sees the step's state (its finished gone)
        self._report(len(self._active) - sum(1 for out in outputs if out.finished and out.req_id in self._active))
        for out in outputs:
            sink = self._active.get(out.req_id)
            if sink is None:
                continue
            if out.finished:
                del self._active[out.req_id]
                self._final(sink, Event.of(out), "finished")
            else:
                self._put(sink, Event.of(out))

    def _drop(self, req_id: str, outcome: str, error: str | None) -> None:
        """End an admitted request early: cancelled by its client (no error) or failed (error)."""
        sink = self._active.pop(req_id, None)
        if sink is None:
            return
        with contextlib.suppress(Exception):
            self.engine.abort(req_id)
        self._final(sink, Event([], "", True, "abort", error=error), outcome)

    def _fail_all(self, error: str, cut: bool = False) -> None:
        for req_id in list(self._active):
            self._num_cut += int(cut)
            self._drop(req_id, "failed", error)

    def _final(self, sink: Sink, ev: Event, outcome: str) -> None:
        with self._cv:  # the slot is free before the client hears its end: its next request must not see 429
            self.counts.add(outcome)
            self._num_in_flight -= 1
        self._put(sink, ev)

    def _put(self, sink: Sink, ev: Event) -> None:
        try:
            sink.put(ev)
        except Exception as e:  # a frontend's delivery failed (the client went away): nothing else to do for it
            self.log("warn", f"cannot deliver an event: {type(e).__name__}: {e}")

    def _report(self, num_active: int | None = None) -> None:
        if self.on_step is None:
            return
        try:
            active = len(self._active) if num_active is None else num_active
            self.on_step(take(self.engine, len(self._pending), active, self.counts))
        except Exception as e:  # metrics must never take the loop down
            self.log("warn", f"metrics update failed: {type(e).__name__}: {e}")
