"""Phase 3 of a step (runtime/core/engine.py), accept: per request, how many of its drafts the verify accepted and
the main model's next token (greedy, exact-match or rejection sampling: runtime/core/sampling.py), with structured
output's masks and the logprobs it returns staged. A request whose sampling fails is reported, not raised, so
the engine aborts it alone.
"""

from __future__ import annotations

import numpy as np

from runtime.core import grammar, logprobs
from runtime.core.mtp_plan import MainPlan
from runtime.core.request import Request
from runtime.core.sampling import accept_exact_match, accept_greedy, accept_rejection, probs_from_logits, sample
from runtime.core.scheduler import ScheduledRequest


def accept_all(scheduled: list[ScheduledRequest], plan: MainPlan, logits: np.ndarray):
    """Per request: accepted draft count a_r, the main model's next token (None: a non-final chunk
    samples nothing), and the error that aborts the request alone (None: fine)."""
    accepted: list[int] = []
    next_tokens: list[int | None] = []
    errors: list[str | None] = []
    for i, s in enumerate(scheduled):
        a, nxt, err = 0, None, None
        if s.reaches_end:
            lo = plan.logit_offsets[i]
            try:
                a, nxt = accept_one(s.req, logits[lo : lo + 1 + s.num_drafts])
            except Exception as e:  # noqa: BLE001 - one request's failure must not fail the batch
                err = f"sampling failed: {type(e).__name__}: {e}"
        accepted.append(a)
        next_tokens.append(nxt)
        errors.append(err)
    return accepted, next_tokens, errors

def accept_one(req: Request, rows: np.ndarray) -> tuple[int, int]:
    """rows [1+k, V]: logits of the last real token and of each draft."""
    if not np.isfinite(rows).all():
        raise FloatingPointError("the main model returned non-finite logits for this request")
    p, spec = req.params, req.spec
    masked = grammar.mask_verify_rows(req, rows, spec.drafts)  # structured output: each row's allowed tokens
    if p.is_greedy:
        a, nxt = accept_greedy(spec.drafts, masked.argmax(-1).tolist())
    elif p.acceptance == "rejection" and spec.drafts and spec.draft_probs is not None:
        a, nxt = accept_rejection(spec.drafts, spec.draft_probs, probs_from_logits(masked, p), req.rng)
    else:
        a, nxt = accept_exact_match(spec.drafts, sample(probs_from_logits(masked, p), req.rng).tolist())
    emitted = [*spec.drafts[:a], nxt]
    logprobs.stage(req, rows, emitted)  # raw (unmasked) main-model logprobs, as vLLM's default
    grammar.advance(req, emitted)
    return a, nxt
