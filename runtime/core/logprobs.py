"""Per-token log-probabilities for requests that ask for them (OpenAI `logprobs` / `echo`), numpy only.

The numbers are the main model's raw distribution, log_softmax(logits) before temperature, top-k, top-p or a
grammar mask (vLLM's default "raw_logprobs"). With MTP on, an accepted draft's logprob is read from the verify
forward's row for that position, which is the row MTP off computes for the same context, so the two agree
within float tolerance (tests/runtime/test_openai_logprobs.py checks it).

The engine calls three hooks, each a no-op for a request that asked for nothing:
  add_prompt_rows / record_prompt  extra logits rows for the prompt positions a prefill chunk computes (echo)
  stage                         after accept: the logprobs of the a+1 tokens this step emits
  commit                        after emit: keep those of the tokens actually emitted (a stop may cut some)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from runtime.core.mtp_plan import MainPlan
    from runtime.core.request import Request
    from runtime.core.scheduler import ScheduledRequest

@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One position: the chosen token's logprob and the `num_top` most likely tokens (most likely first)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """logits [N, V] (row i predicts token_ids[i]) -> N TokenLogprobs; ties in the top list by lower id."""
    lp = log_softmax(logits)
    out = []
    for row, t in zip(lp, token_ids, strict=True):
        top: tuple[int, ...] = ()
        if num_top > 0:
            part = np.argpartition(-row, num_top - 1)[:num_top] if num_top < len(row) else np.arange(len(row))
            top = tuple(int(i) for i in sorted(part.tolist(), key=lambda i: (-row[i], i)))
        out.append(TokenLogprob(int(t), float(row[t]), top, tuple(float(row[i]) for i in top)))
    return out


# ---------------------------------------------------------------------------------------------- engine hooks
def stage(req: Request, rows: np.ndarray, emitted: Sequence[int]) -> None:
    """rows [>= len(emitted), V]: the verify logits (row i predicts emitted[i]); staged until `commit`."""
    n = req.params.logprobs
    req.staged_logprobs = [] if n is None else token_logprobs(rows[: len(emitted)], emitted, n)


def commit(req: Request, num_emitted: int) -> None:
    if req.staged_logprobs:
        req.logprobs += req.staged_logprobs[:num_emitted]
        req.staged_logprobs = []


def add_prompt_rows(scheduled: list[ScheduledRequest], plan: MainPlan) -> list[tuple]:
    """Append to the verify forward's logits rows the prompt positions whose logprobs were asked for; returns
    per request (index, first position, count, first extra row) for `record_prompt`. Position p's logits
    predict prompt token p+1; the last prompt position's predict the first output token (sampled anyway).
    The extra rows go after the sampling rows, so the plan's logit offsets stay valid."""
    row_offsets = plan.row_offsets
    base = len(plan.inp.logit_rows)
    rows: list[int] = []
    spans: list[tuple] = []
    for i, s in enumerate(scheduled):
        req = s.req
        if req.params.prompt_logprobs is None:
            continue
        end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        if end <= s.start:
            continue
        spans.append((i, s.start, end - s.start, base + len(rows)))
        rows += range(row_offsets[i], row_offsets[i] + end - s.start)
    if rows:
        plan.inp.logit_rows = np.concatenate([plan.inp.logit_rows, np.asarray(rows, dtype=np.int64)])
    return spans


def record_prompt(scheduled: list[ScheduledRequest], spans: list[tuple], logits: np.ndarray) -> None:
    """logits: the verify forward's, extra rows included. A preempted request recomputes its
    prompt: positions it already has are not recorded twice."""
    for i, start, count, first in spans:
        req = scheduled[i].req
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None]  # the first prompt token has no logprob
        have = len(req.prompt_logprobs) - 1  # positions 0..have-1 recorded
        skip = max(0, have - start)
        if skip >= count or start > have:
            continue
        targets = req.token_ids[start + skip + 1 : start + count + 1]
        req.prompt_logprobs += token_logprobs(logits[first + skip : first + count], targets,
                                              req.params.prompt_logprobs)  # fmt: skip
