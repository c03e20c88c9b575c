"""Pure planning for one engine step: which rows the main forward, the commit pass and the draft depths
get. No executor, no state changes: inputs are the scheduled requests and numbers, outputs are arrays.

Two plans per step (runtime/engine.py applies them): `plan_main` before verify, and `plan_step` after
accept, which derives everything the rest of the step needs (commit input, chunk carries, rewinds, draft
rows and bases) from the verify results before any request state changes; `plan_draft` shapes one depth.

Notation (docs/RUNTIME.md): a request forwards positions start..start+n-1 (n real tokens) plus its
drafts. After acceptance of `a` drafts, positions 0..base-1 are committed with base = start + n + a
(for a decode step start = P0 and n = 1, so base = P0 + 1 + a).

Commit pass segment of one request (the roll-by-one pairing (h_p, t_{p+1}), invariant 1):

    p from  start - 1   (only with a chunk carry: the seam row, hidden from the previous chunk)
       or   start
    p to    start + n - 2 + a         (the last p whose partner token t_{p+1} is committed and whose
                                       h_p is not the depth-0 input)
    decode:  count = a, start = P0          prefill chunk: count = n - 1 (+1 with carry)

Depth 0 then writes p = base - 1 with (h_{base-1}, base token); depth d writes base - 1 + d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.executors.base import CommitInput, DraftInput, MainInput
from runtime.request import ChunkCarry
from runtime.scheduler import ScheduledRequest


@dataclass(slots=True)
class MainPlan:
    inp: MainInput
    row_offsets: list[int]  # first packed row of each scheduled request
    logit_offsets: list[int]  # first logits row of each request (-1 = no logits: a non-final chunk)


def table_array(tables: list[list[int]], width: int) -> np.ndarray:
    """int32 [R, width] block tables padded with -1; built once per step and shared by every forward."""
    out = np.full((len(tables), width), -1, dtype=np.int32)
    for r, table in enumerate(tables):
        if len(table) > width:
            raise ValueError(f"block table of {len(table)} blocks exceeds the width {width}")
        out[r, : len(table)] = table
    return out


def plan_main(scheduled: list[ScheduledRequest], block_tables: np.ndarray) -> MainPlan:
    ids: list[int] = []
    positions: list[int] = []
    logit_rows: list[int] = []
    row_offsets, logit_offsets = [], []
    for s in scheduled:
        row_offsets.append(len(ids))
        tokens = s.req.token_ids[s.start : s.start + s.num_new_tokens] + s.req.spec.drafts[: s.num_drafts]
        ids += tokens
        positions += range(s.start, s.start + len(tokens))
        if s.reaches_end:  # rows of the last real token and every draft: sampling + verification
            logit_offsets.append(len(logit_rows))
            first = row_offsets[-1] + s.num_new_tokens - 1
            logit_rows += range(first, first + 1 + s.num_drafts)
        else:
            logit_offsets.append(-1)
    inp = MainInput(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        q_counts=np.asarray([s.num_rows for s in scheduled], dtype=np.int32),
        kv_lens=np.asarray([s.start + s.num_rows for s in scheduled], dtype=np.int32),
        block_tables=block_tables,
        logit_rows=np.asarray(logit_rows, dtype=np.int64),
    )
    return MainPlan(inp, row_offsets, logit_offsets)


@dataclass(slots=True)
class CommitSegment:
    """One request's commit rows, before packing (kept for the coverage tests)."""

    start: int  # position of the first row
    hidden: np.ndarray  # float32 [count, H]
    token_ids: list[int]  # t_{p+1} per row


@dataclass(slots=True)
class RequestUpdate:
    """What one scheduled request becomes after this step; applied by the engine, computed before it mutates."""

    num_computed: int  # base: committed positions (the rewind; lookahead blocks stay owned)
    emit: list[int]  # accepted drafts + the main token; [] for a non-final chunk
    num_accepted: int
    carry: ChunkCarry | None  # the next chunk's seam (MTP on, non-final chunk only)
    draft_row: int  # main row of h_{base-1}, depth 0's input; -1 = does not draft
    error: str | None = None  # a per-request inconsistency: the engine aborts this request alone


@dataclass(slots=True)
class StepPlan:
    """The whole post-verify plan of one step, built from the verify results before anything mutates."""

    updates: list[RequestUpdate]  # one per scheduled request, in order
    commit: CommitInput | None  # None: MTP off, or no row to write (no collective inside, so lockstep holds)


def plan_step(
    scheduled: list[ScheduledRequest],
    main: MainPlan,
    hidden: np.ndarray,  # [T, H] this step's main hidden rows
    accepted: list[int],  # a_r per scheduled request (0 for a non-final chunk)
    next_tokens: list[int | None],  # the main model's token per request (None for a non-final chunk)
    *,
    errors: list[str | None] | None = None,  # per request: why accept failed (that request is aborted)
    mtp: bool,  # MTP on: plan the commit pass, chunk carries and draft rows
    draft_depths: int = 1,  # k of this step's draft loop; 0 (auto chose no drafts) folds depth 0 into the commit
    refresh_drafts: bool = True,  # False = --no-commit-pass ablation (decode refresh skipped)
) -> StepPlan:
    """All the hidden-row arithmetic of a step after verify lives here (module docstring has the layout)."""
    updates, segments = [], []
    for i, s in enumerate(scheduled):
        a, off, n = accepted[i], main.row_offsets[i], s.num_new_tokens
        base = s.start + n + a
        nxt = next_tokens[i]
        emit = [] if nxt is None else s.req.spec.drafts[:a] + [nxt]
        upd = RequestUpdate(base, emit, a, None, -1, None if errors is None else errors[i])
        updates.append(upd)
        if upd.error is not None:  # nothing is written for an aborted request, but its segment keeps its place
            segments.append(CommitSegment(s.start, hidden[:0], []))
            continue
        if not mtp:
            continue
        if not s.reaches_end:
            upd.carry = ChunkCarry(s.start + n - 1, hidden[off + n - 1].copy())
        else:
            upd.draft_row = off + n - 1 + a
        # Without a draft loop nobody writes p = base-1, which the next step treats as committed: the commit
        # pass writes depth 0's entry (h_{base-1}, base token) instead (the same write, so invariant 2 holds).
        fold = nxt if draft_depths == 0 and s.reaches_end else None
        if fold is not None:
            upd.draft_row = -1
        try:
            segments.append(commit_segment(s, a, hidden, off, refresh_drafts, fold))
        except ValueError as e:  # this request's state is inconsistent: it alone is aborted, unwritten
            upd.error, upd.draft_row, upd.carry = str(e), -1, None
            segments.append(CommitSegment(s.start, hidden[:0], []))
    commit = None
    if mtp and any(seg.token_ids for seg in segments):
        commit = pack_commit(segments, main.inp.block_tables, hidden.shape[1])
    return StepPlan(updates, commit)


def commit_segment(s: ScheduledRequest, num_accepted: int, main_hidden: np.ndarray, row_offset: int,
                   refresh_drafts: bool = True, base_token: int | None = None) -> CommitSegment:  # fmt: skip
    """Rows (h_p, t_{p+1}) for p in first_p..last_p, from this step's rows plus the carried seam row; with
    base_token, one more row p = base-1 paired with it (depth 0's write, when no draft loop runs)."""
    req, carry = s.req, s.req.spec.carry
    if carry is not None and carry.position != s.start - 1:
        raise ValueError(f"chunk carry of {req.req_id} is for position {carry.position}, "
                         f"but the next chunk starts at {s.start}")  # fmt: skip
    if s.num_drafts and not refresh_drafts:
        if base_token is None:
            return CommitSegment(s.start, main_hidden[:0], [])
        base = s.start + s.num_new_tokens + num_accepted
        row = row_offset + s.num_new_tokens - 1 + num_accepted
        return CommitSegment(base - 1, main_hidden[row : row + 1], [base_token])
    first_p = s.start - (1 if carry is not None else 0)
    last_p = s.start + s.num_new_tokens - 2 + num_accepted
    num_rows = max(0, s.num_new_tokens - 1 + num_accepted) + (base_token is not None)
    hidden = main_hidden[row_offset : row_offset + num_rows]
    if carry is not None:
        hidden = np.concatenate([carry.hidden[None], hidden])
    # t_{p+1} for every row: committed tokens, then (decode) the accepted drafts; no full-list copy
    end = last_p + 2
    tokens = req.token_ids[first_p + 1 : end] + req.spec.drafts[: max(0, end - req.num_tokens)]
    if base_token is not None:
        tokens.append(base_token)
    if len(tokens) != hidden.shape[0]:
        raise ValueError(f"commit plan mismatch for {req.req_id}: {hidden.shape[0]} hiddens vs {len(tokens)} tokens")
    return CommitSegment(first_p, hidden, tokens)


def pack_commit(segments: list[CommitSegment], block_tables: np.ndarray, hidden_size: int) -> CommitInput:
    """One packed varlen write: exactly one (count, start) segment per active request (invariant 5)."""
    hiddens = [seg.hidden for seg in segments if len(seg.token_ids)]
    return CommitInput(
        hidden_in=np.concatenate(hiddens).astype(np.float32) if hiddens else np.zeros((0, hidden_size), np.float32),
        token_ids=np.asarray([t for seg in segments for t in seg.token_ids], dtype=np.int64),
        counts=np.asarray([len(seg.token_ids) for seg in segments], dtype=np.int32),
        starts=np.asarray([seg.start for seg in segments], dtype=np.int32),
        block_tables=block_tables,
    )


def plan_draft(
    hidden: np.ndarray,  # [R, H]
    token_ids: list[int],  # [R]
    bases: list[int],  # [R] base position of each drafting request
    depth: int,
    block_tables: np.ndarray,  # int32 [R, width] of the drafting requests
) -> DraftInput:
    """Depth d writes the MTP plane at base-1+d and attends to 0..base-1+d (derived, never tracked)."""
    return DraftInput(
        hidden_in=hidden.astype(np.float32),
        token_ids=np.asarray(token_ids, dtype=np.int64),
        positions=np.asarray([b - 1 + depth for b in bases], dtype=np.int64),
        counts=np.ones(len(bases), dtype=np.int32),
        block_tables=block_tables,
    )
