"""GET /openapi.json: the OpenAPI 3.1 document of exactly the routes create_app serves.

The request schemas are the pydantic models protocol.py parses with (so the document cannot drift from what
is accepted), tightened where protocol.py checks by hand (prompt, n, logprobs ranges). The response schemas
below describe what response.py writes; tests/runtime/test_openai_compat.py checks every route is in the
document and that real responses validate against it, and schemathesis fuzzes the server from it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from runtime.core.sampling import MAX_TOP_LOGPROBS, SEED_LIMIT
from runtime.serving.limits import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from runtime.serving.openai import protocol as P


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Model(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Out):
    object: Literal["list"]
    data: list[Model]


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class ChatMessageOut(_Out):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Health(_Out):
    status: Literal["ready", "unavailable"]
    in_flight: int


_MODELS = (ErrorResponse, ModelList, CompletionResponse, ChatCompletionResponse, Health, P.CompletionRequest,
           P.ChatCompletionRequest)  # fmt: skip


def _opt(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _tighten(schemas: dict[str, Any], vocab_size: int, max_seq_len: int) -> None:
    """What protocol.py, limits.py and SamplingParams.validate check by hand, stated in the schema too."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}, "minItems": 1,
           "maxItems": max_seq_len - 1}  # fmt: skip
    comp, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    comp["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                                ids, {"type": "array", "items": ids, "minItems": 1}]}  # fmt: skip
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    for props in (comp, chat):
        props["n"] = _opt({"type": "integer", "minimum": 1, "maximum": P.MAX_N})
        for name in ("max_tokens", "max_completion_tokens"):
            props[name] = _opt({"type": "integer", "minimum": 1, "maximum": max_seq_len - 1})
        props["temperature"] = _opt({"type": "number", "minimum": 0})
        props["top_p"] = _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
        props["seed"] = _opt({"type": "integer", "minimum": 0, "maximum": SEED_LIMIT - 1})
        props["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_SEQUENCES},
                                   {"type": "null"}]}  # fmt: skip
        props["guided_choice"] = _opt({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1})
    for name in ("CompletionRequest", "ChatCompletionRequest"):  # stream_options only with stream=true
        schemas[name]["allOf"] = [_needs("stream_options", {"type": "object"}, "stream")]
    schemas["ChatCompletionRequest"]["allOf"].append(_needs("top_logprobs", {"type": "integer"}, "logprobs"))
    guided = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")  # one output constraint at most
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name]["properties"]["guided_regex"] = _opt({"type": "string", "minLength": 1})
        schemas[name]["properties"]["guided_grammar"] = _opt({"type": "string", "minLength": 1})
        schemas[name]["allOf"] += [{"not": {"properties": {a: {"not": {"type": "null"}}, b: {"not": {"type": "null"}}},
                                            "required": [a, b]}}
                                   for i, a in enumerate(guided) for b in guided[i + 1 :]]  # fmt: skip
    schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
    schemas["ResponseFormat"]["if"] = {"properties": {"type": {"const": "json_schema"}}}
    schemas["ResponseFormat"]["then"] = {"required": ["json_schema"], "properties": {
        "json_schema": {"type": "object", "required": ["schema"]}}}  # fmt: skip
    part = schemas["ContentPart"]
    part["properties"] = {"type": {"const": "text"}, "text": {"type": "string"}}
    part["required"], part["additionalProperties"] = ["type", "text"], False
    comp["logprobs"] = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, {"type": "null"}]}
    chat["top_logprobs"] = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
                                      {"type": "null"}]}  # fmt: skip
    schemas["ChatMessage"]["properties"]["role"] = {"type": "string", "enum": list(P.ROLES)}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name]["additionalProperties"] = False  # unknown fields are refused by name (400)


def _needs(name: str, schema: dict, flag: str) -> dict:
    """`name` (when it matches schema) is only allowed with `flag` true."""
    return {"if": {"properties": {name: schema}, "required": [name]},
            "then": {"properties": {flag: {"const": True}}, "required": [flag]}}  # fmt: skip


def _json(ref: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": "error", "content": _json("ErrorResponse")} for c in codes}


# one server-sent event: `data:` is a chunk's JSON, an {"error": ...} JSON, or [DONE]
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
              "required": ["data"]}  # fmt: skip


def _generate_op(req: str, resp: str, summary: str) -> dict:
    body = {"required": True, "content": _json(req)}
    ok = {"description": "the completion (application/json), or server-sent events when stream=true",
          "content": {**_json(resp), "text/event-stream": {"schema": _SSE_EVENT}}}  # fmt: skip
    return {"post": {"summary": summary, "requestBody": body,
                     "responses": {"200": ok, **_errors(400, 404, 405, 413, 429, 503)}}}  # fmt: skip


def document(vocab_size: int, max_seq_len: int) -> dict:
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    _tighten(schemas, vocab_size, max_seq_len)
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "mtp-serve (OpenAI frontend)", "version": "1"},
        "paths": {
            "/v1/models": {"get": {"summary": "the served model", "responses": {
                "200": {"description": "one model", "content": _json("ModelList")}}}},
            "/v1/completions": _generate_op("CompletionRequest", "CompletionResponse", "text completion"),
            "/v1/chat/completions": _generate_op("ChatCompletionRequest", "ChatCompletionResponse", "chat completion"),
            "/health": {"get": {"summary": "readiness", "responses": {
                "200": {"description": "ready", "content": _json("Health")},
                "503": {"description": "draining or the engine loop died", "content": _json("Health")}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "Prometheus text format", "content": text}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {
                "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": schemas},
    }  # fmt: skip


def install_openapi(app: FastAPI, vocab_size: int, max_seq_len: int) -> None:
    doc = document(vocab_size, max_seq_len)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(doc)
