"""One admitted HTTP request's choices (n per prompt, one engine request each): read their event queues, track
latency, and build the OpenAI JSON (whole) or SSE chunks (stream), with logprobs, echo and the opt-in
per-request speculative-decoding metrics (vLLM #48915 shape)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from runtime.serving.openai import protocol as P
from runtime.serving.openai.engine_loop import Event
from runtime.serving.openai.logprob_format import chat_logprobs, completion_logprobs
from runtime.serving.stream_text import TextDelta


class ClientGone(Exception):
    pass


class Choice:
    """One engine request: choice `index` of the response."""

    def __init__(self, index: int, prompt_ids: list[int], params: Any, echo: str | None, leader: bool) -> None:
        self.index, self.prompt_ids, self.params, self.echo = index, prompt_ids, params, echo
        self.text = TextDelta(tuple(params.stop))
        self.leader = leader  # the prompt's first choice: the others start after it, sharing its KV blocks
        self.req_id = ""
        self.queue: asyncio.Queue | None = None
        self.buffered: list[Event] = []  # events read before the response began (a shared prompt's first)
        self.num_out = 0
        self.logprobs: list = []
        self.prompt_logprobs: list = []  # set by the first event of the prompt's first choice
        self.t_first: float | None = None
        self.t_last = 0.0
        self.last: Event | None = None
        self.started = False  # the first chunk (role / echo) was sent

    async def get(self) -> Event:
        if self.buffered:
            return self.buffered.pop(0)
        assert self.queue is not None
        return await self.queue.get()


class ChoiceSet:
    def __init__(self, st: Any, choices: list[Choice], t0: float, chat: bool, model: str, num_prompt_tokens: int,
                 text: Callable[[int], str]) -> None:  # fmt: skip
        self.st, self.choices, self.t0, self.chat = st, choices, t0, chat
        self.num_prompt_tokens, self.text = num_prompt_tokens, text
        self.id = P.new_id("chatcmpl" if chat else "cmpl")
        self.model, self.created = model, P.now()

    # ------------------------------------------------------------------ events
    def _observe(self, c: Choice, ev: Event) -> None:
        n, t = len(ev.new_token_ids), time.perf_counter()
        m = self.st.metrics
        c.logprobs += ev.new_logprobs
        if ev.prompt_logprobs and not c.prompt_logprobs:
            c.prompt_logprobs = ev.prompt_logprobs
        if n:
            if c.t_first is None:
                c.t_first = t
                m.ttft.observe(t - self.t0)
            else:
                for _ in range(n):  # a step that emits n tokens at once: n inter-token gaps of (t - last)/n
                    m.itl.observe((t - c.t_last) / n)
            c.t_last = t
            c.num_out += n
            m.output_tokens.inc(n)
        if ev.finished:
            c.last = ev
            m.requests.labels("failed" if ev.error else ev.finish_reason or "finished").inc()
            if not ev.error:
                m.e2e.observe(t - self.t0)
                if c.num_out > 1 and c.t_first is not None:
                    m.tpot.observe((c.t_last - c.t_first) / (c.num_out - 1))

    @staticmethod
    def _delta(c: Choice, ev: Event) -> str:
        return c.text.next(ev.text, ev.finished)

    def abort_unfinished(self) -> None:
        for c in self.choices:
            if c.req_id and (c.last is None or not c.last.finished):
                self.st.loop.abort(c.req_id)
                self.st.metrics.requests.labels("cancelled").inc()

    # ------------------------------------------------------------------ JSON pieces
    def usage(self) -> dict:
        num_out = sum(c.num_out for c in self.choices)
        cached = sum(c.last.num_cached_tokens for c in self.choices if c.last is not None and c.leader)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": num_out,
                "total_tokens": self.num_prompt_tokens + num_out,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

    def spec_metrics(self) -> dict:
        """vLLM #48915: {"speculative_decoding": {...}} over every choice of the response."""
        k = self.st.num_draft_tokens
        acc = [a for c in self.choices if c.last is not None for a in c.last.accepted_per_step]
        drafted = sum((c.last.num_proposed if c.last.num_proposed is not None else k * len(c.last.accepted_per_step))
                      for c in self.choices if c.last is not None)  # fmt: skip
        steps, accepted = len(acc), int(sum(acc))
        spec = {"mean_acceptance_length": (accepted + steps) / steps if steps else 0.0,
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
                "acceptance_histogram": [sum(a == j for a in acc) for j in range(k + 1)],
                "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted,
                "num_spec_tokens": k}  # fmt: skip
        if self.st.spec_metrics == "detailed":
            spec["per_step_accepted"] = acc
        return {"speculative_decoding": spec}

    def _logprobs(self, c: Choice, entries: list, prompt: bool, offset: int) -> dict | None:
        if c.params.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.text)
        ids = [e.token_id for e in entries]
        if prompt:  # echo: the prompt's tokens first (the first has no logprob), computed by the prompt's leader
            leader = next(x for x in self.choices if x.leader and x.prompt_ids is c.prompt_ids)
            ids, entries = c.prompt_ids + ids, (leader.prompt_logprobs or [None] * len(c.prompt_ids)) + entries
        return completion_logprobs(ids, entries, self.text, offset)

    def _choice(self, c: Choice, text: str, finish: str | None, logprobs: dict | None, first: bool) -> dict:
        if self.chat:
            delta: dict = {"content": text}
            if first:
                delta["role"] = "assistant"
            return {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {"index": c.index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def _chunk(self, choices: list, **extra) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, **extra}  # fmt: skip
        return f"data: {json.dumps(obj)}\n\n"

    def _extra(self) -> dict:
        return {"metrics": self.spec_metrics()} if self.st.spec_metrics != "off" else {}

    # ------------------------------------------------------------------ stream
    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        done = False
        tasks: dict[asyncio.Future, Choice] = {}
        try:
            tasks = {asyncio.ensure_future(c.get()): c for c in self.choices}
            left = len(self.choices)
            while left:
                ready, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for fut in ready:
                    c = tasks.pop(fut)
                    ev = fut.result()
                    self._observe(c, ev)
                    if ev.error:  # one error event (e.g. cut by a drain), then the stream still ends in [DONE]
                        yield f"data: {json.dumps(P.error_body(ev.error))}\n\n"
                        self.abort_unfinished()
                        left = 0
                        break
                    chunk = self._stream_choice(c, ev)
                    if ev.finished:
                        left -= 1
                    else:
                        tasks[asyncio.ensure_future(c.get())] = c
                    if chunk is not None:
                        last = ev.finished and left == 0 and not include_usage
                        yield self._chunk([chunk], **(self._extra() if last else {}))
            done = True
            if include_usage:
                yield self._chunk([], usage=self.usage(), **self._extra())
            yield "data: [DONE]\n\n"
        finally:
            for fut in tasks:
                fut.cancel()
            if not done:  # the client went away (or the server is stopping): free the requests' blocks
                self.abort_unfinished()

    def _stream_choice(self, c: Choice, ev: Event) -> dict | None:
        delta = self._delta(c, ev)
        first = not c.started
        if not (delta or ev.finished or first or ev.new_logprobs):
            return None
        c.started = True
        offset = len(c.text.sent) - len(delta) + (len(c.echo) if c.echo is not None else 0)
        if first and c.echo is not None:
            delta, offset = c.echo + delta, 0
        finish = _finish_reason(ev.finish_reason) if ev.finished else None
        logprobs = self._logprobs(c, list(ev.new_logprobs), first and c.echo is not None, offset)
        return self._choice(c, delta, finish, logprobs, first)

    # ------------------------------------------------------------------ whole
    async def whole(self, request: Request) -> dict | tuple[int, str]:
        """The response JSON, or (status, message) when a choice failed. A client that disconnects aborts every
        choice at once (the watcher), not after they ran to max_tokens."""
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            for c in self.choices:
                while True:
                    get = asyncio.ensure_future(c.get())
                    await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        raise ClientGone
                    ev = get.result()
                    self._observe(c, ev)
                    if ev.finished:
                        break
                if c.last is not None and c.last.error:  # 400: refused at admission; 500: the engine failed it
                    return (400 if c.last.bad_request else 500 if c.last.finish_reason == "error" else 503, c.last.error)
        finally:
            watcher.cancel()
            self.abort_unfinished()
        out = []
        for c in self.choices:
            assert c.last is not None
            ev, finish = c.last, _finish_reason(c.last.finish_reason)
            if self.chat:
                lp = self._logprobs(c, c.logprobs, False, 0)
                out.append({"index": c.index, "message": {"role": "assistant", "content": ev.text, "refusal": None},
                            "finish_reason": finish, "logprobs": lp})  # fmt: skip
            else:
                text = ev.text if c.echo is None else c.echo + ev.text
                lp = self._logprobs(c, c.logprobs, c.echo is not None, 0)
                out.append(self._choice(c, text, finish, lp, False))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": self.usage(),
                **self._extra()}  # fmt: skip


async def _disconnected(request: Request) -> None:
    """Returns when the client of a non-streaming request disconnects (the body is read, so the next ASGI message
    is the disconnect). Streaming needs no watcher: Starlette cancels the response generator."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # OpenAI knows stop | length; abort ends in an error
