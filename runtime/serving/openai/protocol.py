"""OpenAI request/response schema (pydantic) and its translation to engine SamplingParams.

Pure: no engine, no I/O. Unknown request fields are refused by name (ProtocolError -> HTTP 400), so a
client never silently gets a parameter ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.core.sampling import SamplingParams


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str


class _Common(BaseModel):
    # strict: "1" is not 1 and true is not an int; extra: collected, then refused by name in check_extra
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as every OpenAI-compatible server does


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]


SUPPORTED = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))


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
    if extra:
        raise ProtocolError(f"parameter {extra[0]!r} is not supported by this server; supported: "
                            f"{', '.join(SUPPORTED)}", param=extra[0])  # fmt: skip
    if req.n not in (None, 1):
        raise ProtocolError(f"n={req.n}: this server generates one choice per request; send n=1", param="n")
    if req.stream_options is not None and not req.stream:
        raise ProtocolError("stream_options is only allowed with stream=true", param="stream_options")
    return req


def prompt_of(req: CompletionRequest) -> str | list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise ProtocolError(f"prompt is a list of {len(p)} strings: send one prompt per request", "prompt")
        return p[0]
    return p  # type: ignore[return-value]


def sampling_params(req: _Common, default_max_tokens: int) -> SamplingParams:
    """Engine params; value ranges are checked by SamplingParams.validate at admission."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                          max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                          stop=stop)  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
