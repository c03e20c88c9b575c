"""FastAPI routes of the OpenAI frontend: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE),
/health and /metrics.

A request is bounded in bytes before it is parsed or tokenized, parsed strictly (protocol.py), tokenized off
the event loop, validated by the engine's own admission rules, and only then queued on the engine loop.
Every refusal is an OpenAI error JSON with a 4xx status; 5xx is left for real server faults.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from runtime.admission import RequestError, validate_prompt
from runtime.serving.limits import prompt_size_error, stop_error
from runtime.serving.openai import protocol as P
from runtime.serving.openai.body import client_disconnect, read_body
from runtime.serving.openai.engine_loop import AsyncEngineLoop, Event, NotServing, QueueFull
from runtime.serving.openai.metrics import CONTENT_TYPE, ServeMetrics
from runtime.serving.stream_text import TextDelta

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


@dataclass
class ServeState:
    loop: AsyncEngineLoop
    metrics: ServeMetrics
    tokenizer: Any
    model_name: str
    vocab_size: int
    max_seq_len: int
    num_draft_tokens: int
    max_prompt_bytes: int
    chat_template: Any = None  # a jinja2 Template, or None: /v1/chat/completions is then refused


class _ClientGone(Exception):
    pass


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "invalid_request_error")
    return JSONResponse(P.error_body(message, param, kind), status_code=status)


def create_app(st: ServeState, lifespan=None) -> FastAPI:
    app = FastAPI(title="mtp-serve (OpenAI frontend)", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(P.ProtocolError)
    async def _protocol_error(_req: Request, e: P.ProtocolError) -> JSONResponse:
        return _error(e.status, str(e), e.param)

    app.add_exception_handler(ClientDisconnect, client_disconnect)  # one warning line, not a traceback

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405 as OpenAI JSON
        return _error(e.status_code, str(e.detail))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = st.loop.ready
        return JSONResponse({"status": "ready" if ok else "unavailable", "in_flight": st.loop.num_in_flight},
                            status_code=200 if ok else 503)  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0,
                                            "owned_by": "mtp-engine"}]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        req = P.parse(P.CompletionRequest, await read_body(request, st.max_prompt_bytes))
        return await _generate(st, request, req, P.prompt_of(req), False, t0)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        req = P.parse(P.ChatCompletionRequest, await read_body(request, st.max_prompt_bytes))
        if st.chat_template is None:
            raise P.ProtocolError("this model has no chat_template in tokenizer_config.json; use /v1/completions")
        if not req.messages:
            raise P.ProtocolError("messages is empty: send at least one message", "messages")
        prompt = st.chat_template.render(messages=[m.model_dump() for m in req.messages], add_generation_prompt=True)
        return await _generate(st, request, req, prompt, True, t0)

    return app


async def _generate(st: ServeState, request: Request, req: Any, prompt: str | list[int], chat: bool,
                    t0: float) -> Response:  # fmt: skip
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    too_many = stop_error(stops)
    if too_many:
        raise P.ProtocolError(too_many, "stop")
    if isinstance(prompt, str):
        field = "messages" if chat else "prompt"
        too_big = prompt_size_error(len(prompt.encode()), st.max_prompt_bytes, field)
        if too_big:
            raise P.ProtocolError(too_big, field)
        if st.tokenizer is None:
            raise P.ProtocolError("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        # encode_batch releases the GIL, so a long prompt does not stall the engine loop thread
        ids = await asyncio.to_thread(lambda: list(st.tokenizer.encode_batch([prompt])[0].ids))
    else:
        ids = prompt
    try:
        ids = validate_prompt(ids, None, st.vocab_size, st.max_seq_len)
        default = st.max_seq_len - len(ids) if chat else DEFAULT_COMPLETION_MAX_TOKENS
        params = P.sampling_params(req, default)
        params.validate(st.vocab_size)
    except (RequestError, ValueError) as e:
        raise P.ProtocolError(str(e), str(e).split("=", 1)[0] if "=" in str(e)[:24] else None) from None
    try:
        req_id, queue = st.loop.submit(ids, params)
    except QueueFull as e:
        st.metrics.requests.labels("rejected").inc()
        return _error(429, str(e))
    except NotServing as e:
        st.metrics.requests.labels("rejected").inc()
        return _error(503, str(e))
    st.metrics.prompt_tokens.inc(len(ids))
    run = _Run(st, req_id, queue, len(ids), stops, t0, chat, req.model or st.model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(run.sse(include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    try:
        return await run.whole(request)
    except _ClientGone:
        return Response(status_code=499)


class _Run:
    """One admitted request: reads its queue, tracks latency, builds the OpenAI JSON."""

    def __init__(self, st: ServeState, req_id: str, queue: asyncio.Queue, num_prompt: int, stops: tuple[str, ...],
                 t0: float, chat: bool, model: str) -> None:  # fmt: skip
        self.st, self.req_id, self.queue, self.num_prompt, self.t0, self.chat = st, req_id, queue, num_prompt, t0, chat
        self.text = TextDelta(stops)
        self.id = P.new_id("chatcmpl" if chat else "cmpl")
        self.model, self.created = model, P.now()
        self.num_out = 0
        self.t_first: float | None = None
        self.t_last = t0
        self.last: Event | None = None

    async def _next(self) -> Event:
        ev = await self.queue.get()
        if ev is None:  # put by _watch_disconnect: the client of a non-streaming request went away
            raise _ClientGone
        self._observe(ev)
        return ev

    async def _watch_disconnect(self, request: Request) -> None:
        """Non-streaming: wake the reader the moment the client disconnects (the body is read, so the next ASGI
        message is the disconnect), so an abandoned request is aborted at once, not after it ran to max_tokens.
        Streaming needs no watcher: Starlette cancels the response generator on a disconnect."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait(None)

    def _observe(self, ev: Event) -> None:
        n, t = len(ev.new_token_ids), time.perf_counter()
        m = self.st.metrics
        if n:
            if self.t_first is None:
                self.t_first = t
                m.ttft.observe(t - self.t0)
            else:
                for _ in range(n):  # a step that emits n tokens at once: n inter-token gaps of (t - last)/n
                    m.itl.observe((t - self.t_last) / n)
            self.t_last = t
            self.num_out += n
            m.output_tokens.inc(n)
        if ev.finished:
            self.last = ev
            m.requests.labels("failed" if ev.error else ev.finish_reason or "finished").inc()
            if not ev.error:
                m.e2e.observe(t - self.t0)
                if self.num_out > 1 and self.t_first is not None:
                    m.tpot.observe((self.t_last - self.t_first) / (self.num_out - 1))

    def _delta(self, ev: Event) -> str:
        return self.text.next(ev.text, ev.finished)

    def usage(self) -> dict:
        ev = self.last
        return {"prompt_tokens": self.num_prompt, "completion_tokens": self.num_out,
                "total_tokens": self.num_prompt + self.num_out,
                "prompt_tokens_details": {"cached_tokens": ev.num_cached_tokens if ev else 0}}  # fmt: skip

    def spec(self) -> dict:
        ev, k = self.last, self.st.num_draft_tokens
        acc = ev.accepted_per_step if ev else []
        drafted = ev.num_proposed if ev is not None and ev.num_proposed is not None else k * len(acc)
        return {"num_draft_tokens": k, "num_verify_steps": len(acc), "drafted": drafted,
                "accepted": int(sum(acc)), "accepted_per_position": [sum(a > i for a in acc) for i in range(k)]}  # fmt: skip

    def _choice(self, text: str, finish: str | None, first: bool) -> dict:
        if self.chat:
            delta: dict = {"content": text}
            if first:
                delta["role"] = "assistant"
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

    def _chunk(self, choices: list, **extra) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, **extra}  # fmt: skip
        return f"data: {json.dumps(obj)}\n\n"

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        done, first = False, True
        try:
            while True:
                ev = await self._next()  # a disconnect cancels this generator (Starlette)
                if ev.error:
                    done = True
                    yield f"data: {json.dumps(P.error_body(ev.error))}\n\n"
                    break
                delta = self._delta(ev)
                if delta or ev.finished or first:
                    finish = _finish_reason(ev.finish_reason) if ev.finished else None
                    extra = {"spec_decoding": self.spec()} if ev.finished else {}
                    yield self._chunk([self._choice(delta, finish, first)], **extra)
                    first = False
                if ev.finished:
                    done = True
                    break
            if include_usage:
                yield self._chunk([], usage=self.usage())
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the request's blocks
                self.st.loop.abort(self.req_id)
                self.st.metrics.requests.labels("cancelled").inc()

    async def whole(self, request: Request) -> Response:
        done = False
        watcher = asyncio.ensure_future(self._watch_disconnect(request))
        try:
            while True:
                ev = await self._next()
                if ev.finished:
                    done = True
                    break
        finally:
            watcher.cancel()
            if not done:
                self.st.loop.abort(self.req_id)
                self.st.metrics.requests.labels("cancelled").inc()
        if ev.error:
            return _error(400 if ev.bad_request else 503, ev.error)
        text, finish = ev.text, _finish_reason(ev.finish_reason)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                   "logprobs": None} if self.chat else self._choice(text, finish, False))  # fmt: skip
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": [choice],
                             "usage": self.usage(), "spec_decoding": self.spec()})  # fmt: skip


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # OpenAI knows stop | length; abort ends in an error
