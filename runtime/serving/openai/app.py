"""FastAPI routes of the OpenAI frontend: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE),
/health, /metrics and /openapi.json.

A request is bounded in bytes before it is parsed or tokenized, parsed strictly (protocol.py), tokenized off
the event loop, validated by the engine's own admission rules, and only then queued on the engine loop.
Every refusal is an OpenAI error JSON with a 4xx status; 5xx is left for real server faults.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from runtime.core.admission import RequestError, validate_prompt
from runtime.serving.limits import prompt_size_error, stop_error
from runtime.serving.openai import protocol as P
from runtime.serving.openai.body import client_disconnect, read_body
from runtime.serving.openai.engine_loop import AsyncEngineLoop, NotServing, QueueFull
from runtime.serving.openai.logprob_format import token_text
from runtime.serving.openai.metrics import CONTENT_TYPE, ServeMetrics
from runtime.serving.openai.openapi import install_openapi
from runtime.serving.openai.response import Choice, ChoiceSet, ClientGone
from runtime.serving.openai.structured import Structured

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
    structured: Structured | None = None  # response_format / guided_*: None refuses them
    spec_metrics: str = "off"  # per-request speculative stats in responses: off | summary | detailed
    text_of: Any = None  # token id -> its text (logprobs), made by create_app


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "invalid_request_error")
    return JSONResponse(P.error_body(message, param, kind), status_code=status, headers=headers)


def create_app(st: ServeState, lifespan=None) -> FastAPI:
    st.text_of = st.text_of or token_text(st.tokenizer)
    app = FastAPI(title="mtp-serve (OpenAI frontend)", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(P.ProtocolError)
    async def _protocol_error(_req: Request, e: P.ProtocolError) -> JSONResponse:
        return _error(e.status, str(e), e.param)

    app.add_exception_handler(ClientDisconnect, client_disconnect)  # one warning line, not a traceback

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405 as OpenAI JSON
        return _error(e.status_code, str(e.detail), headers=getattr(e, "headers", None))  # 405 keeps its Allow

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
        return await _generate(st, request, req, P.prompts_of(req), False, t0)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        req = P.parse(P.ChatCompletionRequest, await read_body(request, st.max_prompt_bytes))
        if st.chat_template is None:
            raise P.ProtocolError("this model has no chat_template in tokenizer_config.json; use /v1/completions")
        if not req.messages:
            raise P.ProtocolError("messages is empty: send at least one message", "messages")
        messages = [P.message_text(m, i) for i, m in enumerate(req.messages)]
        prompt = st.chat_template.render(messages=messages, add_generation_prompt=True)
        return await _generate(st, request, req, [prompt], True, t0)

    install_openapi(app, st.vocab_size, st.max_seq_len)
    return app


async def _prompt_ids(st: ServeState, prompt: str | list[int], chat: bool) -> list[int]:
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
        return validate_prompt(ids, None, st.vocab_size, st.max_seq_len)
    except RequestError as e:
        raise P.ProtocolError(str(e), "messages" if chat else "prompt") from None


async def _choices(st: ServeState, req: Any, prompts: list[str | list[int]], chat: bool) -> list[Choice]:
    """Every choice of the request (n per prompt, index = prompt * n + i, as vLLM), validated, not submitted."""
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    too_many = stop_error(stops)
    if too_many:
        raise P.ProtocolError(too_many, "stop")
    if st.structured is None and _constrained(req):
        raise P.ProtocolError("structured output is not available on this server (no tokenizer)", "response_format")
    grammar = await st.structured.grammar_of(req) if st.structured is not None else None
    n, echo = req.n or 1, bool(getattr(req, "echo", False))
    want_prompt_logprobs = echo and P.num_logprobs(req) is not None
    text = st.text_of
    out = []
    for pi, prompt in enumerate(prompts):
        ids = await _prompt_ids(st, prompt, chat)
        default = st.max_seq_len - len(ids) if chat else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = P.max_tokens_of(req, len(ids), st.max_seq_len, default)
        shown = None if not echo else prompt if isinstance(prompt, str) else "".join(text(t) for t in ids)
        for i in range(n):
            params = P.sampling_params(req, max_tokens, i, grammar, prompt_logprobs=want_prompt_logprobs and i == 0)
            try:
                params.validate(st.vocab_size)
            except ValueError as e:
                raise P.ProtocolError(str(e), str(e).split("=", 1)[0] if "=" in str(e)[:24] else None) from None
            out.append(Choice(pi * n + i, ids, params, shown, leader=i == 0))
    return out


def _constrained(req: Any) -> bool:
    rf = req.response_format
    return (rf is not None and rf.type != "text") or any(
        getattr(req, f) is not None for f in ("guided_json", "guided_regex", "guided_grammar", "guided_choice"))


async def _submit(st: ServeState, choices: list[Choice]) -> JSONResponse | None:
    """Queue the choices on the engine loop. A prompt's first choice goes first; the prompt's other choices
    follow once it has prefilled, so they read its KV blocks from the prefix cache instead of recomputing
    them. Returns an error response (429 / 503 / 400), with everything already queued aborted."""
    submitted: list[Choice] = []

    def put(c: Choice) -> None:
        c.req_id, c.queue = st.loop.submit(c.prompt_ids, c.params)
        submitted.append(c)

    try:
        for c in choices:
            if c.leader:
                put(c)
        for leader in [c for c in choices if c.leader]:
            followers = [c for c in choices if c.prompt_ids is leader.prompt_ids and not c.leader]
            if not followers:
                continue
            assert leader.queue is not None
            first = await leader.queue.get()
            leader.buffered.append(first)
            leader.prompt_logprobs = first.prompt_logprobs  # echo: the followers show the leader's
            if first.error:
                break  # the leader failed: the response reports its error; the followers never start
            for c in followers:
                put(c)
    except (QueueFull, NotServing) as e:
        for c in submitted:
            st.loop.abort(c.req_id)
        st.metrics.requests.labels("rejected").inc()
        return _error(429 if isinstance(e, QueueFull) else 503, str(e))
    except asyncio.CancelledError:
        for c in submitted:
            st.loop.abort(c.req_id)
        raise
    return None


async def _generate(st: ServeState, request: Request, req: Any, prompts: list[str | list[int]], chat: bool,
                    t0: float) -> Response:  # fmt: skip
    choices = await _choices(st, req, prompts, chat)
    failed = await _submit(st, choices)
    if failed is not None:
        return failed
    choices = [c for c in choices if c.queue is not None]  # a failed leader: its followers never ran
    num_prompt = sum(len(c.prompt_ids) for c in choices if c.leader)
    st.metrics.prompt_tokens.inc(num_prompt)
    resp = ChoiceSet(st, choices, t0, chat, req.model or st.model_name, num_prompt, st.text_of)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(resp.sse(include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    try:
        body = await resp.whole(request)
    except ClientGone:
        return Response(status_code=499)
    if isinstance(body, tuple):
        return _error(body[0], body[1])
    return JSONResponse(body)
