"""The draft loop of one step (phase 7 of runtime/core/engine.py): k serial MTP depths from (h_{base-1}, base token).

Depth d writes the MTP plane at base-1+d for the requests with k_i > d (a fixed K: every request, every depth;
--num-draft-tokens per-request: the packed rows shrink per depth, runtime/core/verify_lengths.py). A depth with no
request left here (a lockstep rank whose requests stopped earlier than another rank's) is one padded row, so
every rank issues the same number of collective-bearing draft forwards (invariant 9).

Host work per depth is one argmax over the depth's logits for the rows that draft by argmax with no grammar (greedy
requests, and sampled ones whose exact-match acceptance still drafts the argmax: sampling.draft_token), and the
per-row path (grammar mask, sampled draft and its probs) only for the others.

The draft loop in one call: a compiled engine built with K >= 2 on one rank has a package running all K depths with
an in-graph argmax and per-row depth counts (builder/fused_draft.py; a row past its k_i writes only the null block).
The engine hands it in (`fused_call`) unless RuntimeConfig.fused_draft is off or the ranks run in lockstep (whose
form must not depend on one rank's rows), and `run` takes it for a step that drafts K deep with every row drafting
by argmax; any other step (a grammar or a rejection-sampled request, a shallower k) runs one call per depth. Measured
in the engine (docs/PERFORMANCE.md "The draft loop in one call?"): the fused form is the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from runtime.core import grammar
from runtime.core.mtp_plan import RequestUpdate, plan_draft, plan_fused_draft
from runtime.core.request import Request
from runtime.core.sampling import draft_token
from runtime.executors.base import DraftInput, DraftOutput, FusedDraftInput


def run(run_draft: Callable[[DraftInput], DraftOutput], idle_draft: Callable[[], None], reqs: list[Request],
        updates: list[RequestUpdate], main_hidden: np.ndarray, tables: np.ndarray, k_i: list[int], k: int,
        run_fused: Callable[[FusedDraftInput], np.ndarray] | None = None) -> dict[int, str]:  # fmt: skip
    """Appends each request's drafts (and draft probs) to its SpecState. Returns the requests (index into reqs)
    that failed, with why: the caller aborts them after the loop (a failed row keeps its place in every depth,
    so the batch shape and the lockstep call count never change). k may differ from the previous step's: the
    next verify checks exactly the drafts made here. run_fused: the k depths in one call (given only when the
    executor's fused package drafts exactly k deep and the engine runs alone), taken when every row drafts by argmax."""
    bases = [u.num_computed for u in updates]
    failed: dict[int, str] = {}
    for j, (r, b) in enumerate(zip(reqs, bases, strict=True)):
        if r.num_tokens - 1 != b:  # invariant 3: the draft start is derived from base, never tracked
            failed[j] = f"base position {b} is not the last token's ({r.num_tokens - 1})"
    hidden = main_hidden[[u.draft_row for u in updates]]
    tokens = [r.token_ids[-1] for r in reqs]
    plain = [_drafts_argmax(r) for r in reqs]  # fixed for the loop: a request's policy does not change mid-step
    if run_fused is not None and all(plain):
        drafts = run_fused(plan_fused_draft(hidden, tokens, bases, tables[: len(reqs)], k_i)).tolist()
        for r, row, n in zip(reqs, drafts, k_i, strict=True):
            r.spec.drafts.extend(row[:n])  # depths past k_i wrote the null block; their drafts are dropped here
    else:
        _per_depth(run_draft, idle_draft, reqs, hidden, tokens, bases, plain, tables, k_i, k, failed)
    for r in reqs:
        grammar.end_drafts(r)  # matcher back at the last emitted token; drafts it rejected are cut
    return failed


def _per_depth(run_draft: Callable[[DraftInput], DraftOutput], idle_draft: Callable[[], None], reqs: list[Request],
               hidden: np.ndarray, tokens: list[int], bases: list[int], plain: list[bool], tables: np.ndarray,
               k_i: list[int], k: int, failed: dict[int, str]) -> None:  # fmt: skip
    """One executor call per depth, the rows shrinking as requests reach their k_i."""
    probs: list[list[np.ndarray]] = [[] for _ in reqs]
    rows = list(range(len(reqs)))  # the requests whose rows `hidden` holds, in order
    for depth in range(k):
        if any(k_i[j] <= depth for j in rows):  # their drafts are done: drop their rows (a prefix of depths each)
            hidden = hidden[[n for n, j in enumerate(rows) if k_i[j] > depth]]
            rows = [j for j in rows if k_i[j] > depth]
        if not rows:
            idle_draft()
            continue
        out = run_draft(plan_draft(hidden, [tokens[j] for j in rows], [bases[j] for j in rows], depth, tables[rows]))
        top = out.logits.argmax(axis=1).tolist() if any(plain[j] for j in rows) else None
        for n, j in enumerate(rows):
            r = reqs[j]
            if plain[j]:  # == draft_token on unmasked logits, without the per-row call
                tokens[j] = top[n]  # type: ignore[index]
                r.spec.drafts.append(tokens[j])
                continue
            try:
                tokens[j] = draft_token(r.params, r.rng, grammar.mask_draft(r, out.logits[n : n + 1]), probs[j])
                grammar.push_draft(r, tokens[j])
            except Exception as e:  # noqa: BLE001 - one request's failure must not fail the batch
                failed.setdefault(j, f"drafting failed: {type(e).__name__}: {e}")
            r.spec.drafts.append(tokens[j])
        hidden = out.hidden_out
    for j, r in enumerate(reqs):
        if j not in failed and probs[j]:
            r.spec.draft_probs = np.stack(probs[j])


def fused_call(executor: object, enabled: bool, lockstep: bool) -> tuple[int, Any]:
    """(K, the executor's K-depth call) when the engine may use the fused draft loop (the compiled executor's, when its
    engine has the package), else (0, None): switched off (RuntimeConfig.fused_draft), or lockstep ranks, which keep
    one call per depth so that every rank issues the same collective-bearing forwards whatever its rows' policies."""
    k = int(getattr(executor, "fused_draft_depths", 0)) if enabled and not lockstep else 0
    if k:
        executor.load_fused_draft()  # type: ignore[attr-defined]  # only now: it costs memory
    return k, getattr(executor, "run_fused_draft", None) if k else None


def _drafts_argmax(r: Request) -> bool:
    """Whether draft_token would return the argmax of r's unmasked logits (so one batched argmax serves it)."""
    p = r.params
    return p.grammar is None and not (p.acceptance == "rejection" and not p.is_greedy)
