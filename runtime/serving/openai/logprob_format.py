"""runtime.core.logprobs.TokenLogprob lists -> the OpenAI `logprobs` objects of completions and chat choices."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from runtime.core.logprobs import TokenLogprob


def token_text(tokenizer: Any) -> Callable[[int], str]:
    """id -> the token's text (each token decoded alone, as vLLM); `token_id:N` without a tokenizer."""
    if tokenizer is None:
        return lambda t: f"token_id:{t}"
    return lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))


def completion_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprob | None], text: Callable[[int], str],
                        offset: int) -> dict:  # fmt: skip
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; None entries (the first prompt token) have
    no logprob. offset: where the first token's text starts in the choice's text."""
    tokens = [text(t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {text(t): lp for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)}
                             for e in entries],
            "text_offset": offsets}  # fmt: skip


def _entry(t: int, logprob: float, text: Callable[[int], str]) -> dict:
    s = text(t)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], text: Callable[[int], str]) -> dict:
    return {"content": [{**_entry(e.token_id, e.logprob, text),
                         "top_logprobs": [_entry(t, lp, text) for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)]}
                        for e in entries], "refusal": None}  # fmt: skip
