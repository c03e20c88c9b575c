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

from runtime.core.admission import RequestError, validate_prompt
from runtime.serving.openai import protocol as P
from runtime.serving.openai.engine_loop import EngineLoop, Event, NotServing, QueueFull
from runtime.serving.openai.metrics import CONTENT_TYPE, ServeMetrics

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


@dataclass
class ServeState:
    loop: EngineLoop
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
        req = P.parse(P.CompletionRequest, await _body(request, st.max_prompt_bytes))
        return await _generate(st, request, req, P.prompt_of(req), False, t0)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        req = P.parse(P.ChatCompletionRequest, await _body(request, st.max_prompt_bytes))
        if st.chat_template is None:
            raise P.ProtocolError("this model has no chat_template in tokenizer_config.json; use /v1/completions")
        if not req.messages:
            raise P.ProtocolError("messages is empty: send at least one message", "messages")
        prompt = st.chat_template.render(messages=[m.model_dump() for m in req.messages], add_generation_prompt=True)
        return await _generate(st, request, req, prompt, True, t0)

    return app


async def _body(request: Request, max_prompt_bytes: int) -> bytes:
    """The request body, refused with 413 once it exceeds the bound (before parsing anything)."""
    limit = 2 * max_prompt_bytes + 65536  # JSON escaping may double a prompt; the rest is parameters
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.ProtocolError(f"request body is {declared} bytes; this server accepts at most {limit} "
                              "(start mtp-serve with a larger --max-prompt-bytes)", status=413)  # fmt: skip
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.ProtocolError(f"request body exceeds {limit} bytes (start mtp-serve with a larger "
                                  "--max-prompt-bytes)", status=413)  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


async def _generate(st: ServeState, request: Request, req: Any, prompt: str | list[int], chat: bool,
                    t0: float) -> Response:  # fmt: skip
    if isinstance(prompt, str):
        size = len(prompt.encode())
        if size > st.max_prompt_bytes:
            raise P.ProtocolError(f"prompt is {size} bytes; this server accepts at most {st.max_prompt_bytes} "
                                  "(--max-prompt-bytes): shorten it", "messages" if chat else "prompt")  # fmt: skip
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
    run = _Run(st, req_id, queue, len(ids), req.stop, t0, chat, req.model or st.model_name)
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

    def __init__(self, st: ServeState, req_id: str, queue: asyncio.Queue, num_prompt: int, stop: Any, t0: float,
                 chat: bool, model: str) -> None:  # fmt: skip
        self.st, self.req_id, self.queue, self.num_prompt, self.t0, self.chat = st, req_id, queue, num_prompt, t0, chat
        self.stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        self.id = P.new_id("chatcmpl" if chat else "cmpl")
        self.model, self.created = model, P.now()
        self.num_out, self.sent = 0, ""
        self.t_first: float | None = None
        self.t_last = t0
        self.last: Event | None = None

    async def _next(self, request: Request | None) -> Event:
        if request is None:  # streaming: Starlette cancels us on a disconnect, so no polling (and no timer task)
            ev = await self.queue.get()
            self._observe(ev)
            return ev
        while True:
            try:
                ev = await asyncio.wait_for(self.queue.get(), 0.5)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise _ClientGone from None
                continue
            self._observe(ev)
            return ev

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
        text = ev.text if ev.finished else _stable_text(ev.text, self.stops)
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

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
                ev = await self._next(None)  # a disconnect cancels this generator (Starlette)
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
        try:
            while True:
                ev = await self._next(request)
                if ev.finished:
                    done = True
                    break
        finally:
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


def _stable_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a growing text safe to stream: no half-decoded character at the end, and nothing that may
    still become the start of a stop string (the engine cuts the text there)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold] if hold else text


