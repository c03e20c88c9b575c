"""Request admission: the complete, pure validation of one request before the engine queues it.

Owns the prompt contract (`validate_prompt`) and the request-id contract; the sampling policy's own
checks live in `SamplingParams.validate` (runtime/core/sampling.py) and are called from `validate_params`.
Everything here raises `RequestError` with one line naming the problem and the fix, and has no side
effects, so a rejected request changes nothing in the engine and cannot fail a later step for the
others (a value that slips through here surfaces as a TypeError inside engine.step() for the whole batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.core.sampling import SamplingParams, is_int


class RequestError(ValueError):
    """A bad request: rejected alone, the engine keeps serving the others."""


def validate_params(params: SamplingParams | None, vocab_size: int) -> SamplingParams:
    """The request's SamplingParams (defaults for None), checked field by field."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}; "
                           "build one with SamplingParams(temperature=..., max_tokens=...)")  # fmt: skip
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return params


def validate_request_id(req_id: object) -> str | None:
    if req_id is not None and (not isinstance(req_id, str) or not req_id):
        raise RequestError(f"request id {req_id!r} must be a non-empty str (or None for an automatic id)")
    return req_id


def validate_prompt(prompt: object, tokenizer, vocab_size: int, max_seq_len: int) -> list[int]:
    """Token ids of a prompt: a str (needs a tokenizer) or a flat list/tuple/1-D array of integer ids.

    Python ints and numpy integer scalars are ids; bool, float, bytes and nested sequences are rejected
    rather than reinterpreted (bytes would iterate as ints, 2.7 would truncate to 2, True would be id 1).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("text prompt given but the engine has no tokenizer; pass token ids")
        ids = [int(t) for t in tokenizer.encode(prompt).ids]
    else:
        ids = _token_ids(prompt)
    if not ids:
        raise RequestError("empty prompt: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_seq_len:
        raise RequestError(f"prompt has {len(ids)} tokens but max_seq_len is {max_seq_len}: "
                           "shorten it or raise max_seq_len")  # fmt: skip
    return ids


def _token_ids(prompt: object) -> list[int]:
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise RequestError("prompt is bytes: decode it to str (prompt.decode('utf-8')) or pass a list of token ids")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise RequestError(f"prompt array must be 1-D integer token ids, got shape {prompt.shape} "
                               f"dtype {prompt.dtype}")  # fmt: skip
        return [int(t) for t in prompt]
    if not isinstance(prompt, Sequence):
        raise RequestError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
    for i, t in enumerate(prompt):
        if not is_int(t):
            raise RequestError(f"prompt[{i}] = {t!r} ({type(t).__name__}) is not a token id: "
                               "pass a str or a flat list of ints")  # fmt: skip
    return [int(t) for t in prompt]
