"""OpenAI request/response schema (pydantic) and its translation to engine SamplingParams.

Pure: no engine, no I/O. Unknown request fields are refused by name (ProtocolError -> HTTP 400), so a
client never silently gets a parameter ignored. docs/SERVING.md has the table of every OpenAI field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from runtime.core.sampling import MAX_TOP_LOGPROBS, SEED_LIMIT, SamplingParams

MAX_N = 16  # choices per request (each is an engine request; the prompt's KV is shared via the prefix cache)
ROLES = ("system", "developer", "user", "assistant")


class ProtocolError(ValueError):
    """A bad request body: becomes an OpenAI error JSON with HTTP `status` (4xx)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # image_url & co: refused by type in message_text
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted and ignored by the chat template, as vLLM


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # strict or not, the output is held to the schema (xgrammar's strict mode, as vLLM)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    # strict: "1" is not 1 and true is not an int; extra: collected, then refused by name in check_extra
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens (OpenAI deprecated max_tokens for it)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as every OpenAI-compatible server does
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extra fields (one constraint per request, response_format included)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # EBNF (GBNF), as xgrammar reads it
    guided_choice: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """3.0 is the integer 3 in JSON (and JSON Schema); "3" and true stay refused (strict)."""
        if isinstance(data, dict):
            for name in _INT_FIELDS:
                value = data.get(name)
                if isinstance(value, float) and value.is_integer():
                    data[name] = int(value)
        return data


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "n", "logprobs", "top_logprobs")


class CompletionRequest(_Common):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]: checked by prompts_of for a clear message
    echo: bool | None = None
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's logprob only)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None


SUPPORTED = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))


# Unsupported features a client sends together with their modifiers (LangChain's function calling sends `tools`
# with `parallel_tool_calls`): the refusal names the feature.
FEATURES = {"tools": " (no tool calling)", "tool_choice": " (no tool calling)", "functions": " (no function calling)",
            "function_call": " (no function calling)"}  # fmt: skip


def parse(model: type[_Common], body: bytes) -> Any:
    """Validate a JSON body; raise ProtocolError naming the first bad field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or None
        where = f"{loc}: " if loc else ""
        raise ProtocolError(f"{where}{err['msg']}", param=loc) from None
    extra = [k for k, v in (req.model_extra or {}).items() if v is not None]
    extra.sort(key=lambda k: k not in FEATURES)  # name the feature, not a modifier of it (parallel_tool_calls)
    if extra:
        what = FEATURES.get(extra[0], "")
        raise ProtocolError(f"parameter {extra[0]!r} is not supported by this server{what}; supported: "
                            f"{', '.join(SUPPORTED)}", param=extra[0])  # fmt: skip
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise ProtocolError(f"n={req.n}: must be an int in [1, {MAX_N}] (choices per prompt)", param="n")
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise ProtocolError(f"seed={req.seed}: must be an int in [0, 2**64)", param="seed")
    if req.stream_options is not None and not req.stream:
        raise ProtocolError("stream_options is only allowed with stream=true", param="stream_options")
    _check_logprobs(req)
    return req


def _check_logprobs(req: _Common) -> None:
    if isinstance(req, CompletionRequest):
        n, name = req.logprobs, "logprobs"
    elif isinstance(req, ChatCompletionRequest):
        n, name = req.top_logprobs, "top_logprobs"
        if n is not None and not req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", param="top_logprobs")
    else:
        return
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ProtocolError(f"{name}={n}: must be an int in [0, {MAX_TOP_LOGPROBS}]", param=name)


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ids(x: object) -> object:
    """JSON's 157.0 is the integer 157: token ids given as integral floats become ints (2.7 stays refused)."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if isinstance(x, list):
        return [_ids(v) for v in x]
    return x


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    p = _ids(req.prompt)
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) and all(_is_id(t) for t in x) for x in p):
            return list(p)
        if all(_is_id(x) for x in p):
            return [p]
    if isinstance(p, list) and not p:
        raise ProtocolError("prompt is an empty list: send a string or at least one token id", "prompt")
    raise ProtocolError(f"prompt must be a string, a list of strings, a list of token ids (ints) or a list of "
                        f"token-id lists; got {type(p).__name__}", "prompt")  # fmt: skip


def message_text(msg: ChatMessage, i: int) -> dict:
    """{"role", "content"} for the chat template: text parts joined with newlines (as vLLM)."""
    if msg.role not in ROLES:
        raise ProtocolError(f"messages[{i}].role {msg.role!r} is not supported; use one of {', '.join(ROLES)}",
                            f"messages.{i}.role")  # fmt: skip
    content = msg.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            extra = [k for k in part.model_extra or {} if part.type == "text"]
            if extra:
                raise ProtocolError(f"messages[{i}].content[{j}].{extra[0]} is not a field of a text part",
                                    f"messages.{i}.content.{j}.{extra[0]}")  # fmt: skip
            if part.type != "text" or part.text is None:
                raise ProtocolError(f"messages[{i}].content[{j}] has type {part.type!r}: this model takes text "
                                    "parts only ({\"type\": \"text\", \"text\": ...})",
                                    f"messages.{i}.content.{j}.type")  # fmt: skip
        content = "\n".join(part.text or "" for part in content)
    return {"role": msg.role, "content": content or ""}


def max_tokens_of(req: _Common, num_prompt: int, max_seq_len: int, default: int) -> int:
    """max_completion_tokens wins over max_tokens; a request beyond the context is refused as OpenAI/vLLM do.
    0 is a scoring request (completions with echo and logprobs: the prompt's logprobs, nothing generated)."""
    scoring = bool(getattr(req, "echo", False)) and num_logprobs(req) is not None
    for name in ("max_tokens", "max_completion_tokens"):  # each one given is checked, the winner or not
        asked = getattr(req, name)
        if asked is not None and asked < (0 if scoring else 1):
            raise ProtocolError(f"{name}={asked}: must be an int >= 1 (output tokens to generate), or 0 with echo "
                                "and logprobs (the prompt's logprobs only)", name)  # fmt: skip
        if asked is not None and num_prompt + asked > max_seq_len:
            raise ProtocolError(f"This model's maximum context length is {max_seq_len} tokens. However, you "
                                f"requested {num_prompt + asked} tokens ({num_prompt} in the messages, {asked} in the "
                                "completion). Please reduce the length of the messages or completion.", name)  # fmt: skip
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens if req.max_tokens is not None else max(1, min(default, max_seq_len - num_prompt))


def sampling_params(req: _Common, max_tokens: int, index: int = 0, grammar: Any = None,
                    prompt_logprobs: bool = False) -> SamplingParams:  # fmt: skip
    """Engine params of choice `index` (a seeded request's choice i samples with seed + i, as vLLM); value ranges
    are checked by SamplingParams.validate at admission."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    seed = None if req.seed is None else (req.seed + index) % SEED_LIMIT
    logprobs = num_logprobs(req)
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, seed=seed, max_tokens=max_tokens,
                          stop=stop, logprobs=logprobs, prompt_logprobs=logprobs if prompt_logprobs else None,
                          grammar=grammar)  # fmt: skip


def num_logprobs(req: _Common) -> int | None:
    """Top alternatives per output token, or None: logprobs not asked for."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs if isinstance(req, CompletionRequest) else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
