"""Pure planning for one engine step: which rows the main forward, the commit pass and the draft depths
get. No executor, no state changes: inputs are the scheduled requests and numbers, outputs are arrays.

Two plans per step (runtime/core/engine.py applies them): `plan_main` before verify, and `plan_step` after
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

from runtime.core.block_pool import NULL_BLOCK_ID
from runtime.core.draft_length import StepSample
from runtime.core.request import ChunkCarry
from runtime.core.scheduler import ScheduledRequest
from runtime.core.verify_lengths import Candidate
from runtime.executors.base import CommitInput, DraftInput, FusedDraftInput, MainInput


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
    mtp_frozen_at: int | None = None  # set: the request stops keeping its MTP plane from this position on


@dataclass(slots=True)
class StepPlan:
    """The whole post-verify plan of one step, built from the verify results before anything mutates."""

    updates: list[RequestUpdate]  # one per scheduled request, in order
    commits: list[CommitInput]  # [] when MTP is off or no row is written; > 1 only when carried rows overflow one
    # commit's row limit (no collective inside a commit, so ranks may issue different numbers of them)


def plan_step(
    scheduled: list[ScheduledRequest],
    main: MainPlan,
    hidden: np.ndarray,  # [T, H] this step's main hidden rows
    accepted: list[int],  # a_r per scheduled request (0 for a non-final chunk)
    next_tokens: list[int | None],  # the main model's token per request (None for a non-final chunk)
    *,
    errors: list[str | None] | None = None,  # per request: why accept failed (that request is aborted)
    mtp: bool,  # MTP on: plan the commit pass, chunk carries and draft rows
    draft_depths: int | list[int] = 1,  # k of this step's draft loop (0: `auto` chose not to draft), or k_i per
    # request (--num-draft-tokens per-request: runtime/core/verify_lengths.py)
    refresh_drafts: bool = True,  # False = --no-commit-pass ablation (decode refresh skipped)
    max_carry_rows: int = 16,  # with k = 0: rows a request may hold back before every carry is written
    max_commit_rows: int | None = None,  # rows one commit call may carry (the engine's token budget)
    freeze: bool = False,  # `auto` gave up drafting: requests that verified no drafts stop keeping their MTP plane
) -> StepPlan:
    """All the hidden-row arithmetic of a step after verify lives here (module docstring has the layout).

    With k = 0 (per request: k_i = 0) nobody runs its depth 0, so row p = base-1 (h_{base-1}, base token) is written by the commit pass
    instead. To keep K=0-like steps free of a commit call, such rows are carried (like a chunk seam) while
    no request has other rows to write and no carry is full; the next commit then writes them all. Carried rows
    of a batch can outnumber one commit's row limit (8 requests x 64 rows > 256), so the write is split into
    commits of whole requests that each fit (`pack_commits`).

    A request whose MTP plane is frozen (`SpecState.mtp_frozen_at`) writes nothing and drafts no more; with
    `freeze` every request that reaches its end without drafts to refresh freezes now: its carry is dropped
    unwritten, so its plane stays exact below the first unwritten position (main KV and outputs are untouched).
    """
    errors = errors if errors is not None else [None] * len(scheduled)
    ks = [draft_depths] * len(scheduled) if isinstance(draft_depths, int) else draft_depths
    freezing = [freeze and mtp and err is None and s.reaches_end and not s.num_drafts and s.req.spec.may_draft
                for s, err in zip(scheduled, errors, strict=True)]  # fmt: skip
    writes = [mtp and s.req.spec.may_draft and not f for s, f in zip(scheduled, freezing, strict=True)]
    defer = mtp and not any(ks) and all(
        not w or err is not None or (s.num_new_tokens - 1 + a == 0 and _carried(s) < max_carry_rows)
        for s, a, err, w in zip(scheduled, accepted, errors, writes, strict=True))  # fmt: skip
    updates, segments = [], []
    for i, s in enumerate(scheduled):
        a, nxt = accepted[i], next_tokens[i]
        emit = [] if nxt is None else s.req.spec.drafts[:a] + [nxt]
        upd = RequestUpdate(s.start + s.num_new_tokens + a, emit, a, None, -1, errors[i])
        updates.append(upd)
        if not mtp:
            continue
        seg = None
        if freezing[i]:  # the first position it leaves unwritten (carried rows included)
            upd.mtp_frozen_at = s.start if s.req.spec.carry is None else s.req.spec.carry.position
        if upd.error is None and writes[i]:
            try:
                seg, upd.carry = _plan_rows(s, a, nxt, hidden, main.row_offsets[i], ks[i], defer,
                                            refresh_drafts)  # fmt: skip
            except ValueError as e:  # this request's state is inconsistent: it alone is aborted, unwritten
                upd.error = str(e)
        if seg is None:  # nothing is written for an aborted or frozen request, but its segment keeps its place
            segments.append(CommitSegment(s.start, hidden[:0], []))
            continue
        segments.append(seg)
        if s.reaches_end and ks[i] > 0:
            upd.draft_row = main.row_offsets[i] + s.num_new_tokens - 1 + a
    commits = []
    if mtp and any(seg.token_ids for seg in segments):
        commits = pack_commits(segments, main.inp.block_tables, hidden.shape[1], max_commit_rows)
    return StepPlan(updates, commits)


def _carried(s: ScheduledRequest) -> int:
    carry = s.req.spec.carry
    return 0 if carry is None else len(carry.hidden)


def _plan_rows(s: ScheduledRequest, a: int, next_token: int | None, main_hidden: np.ndarray, off: int,
               draft_depths: int, defer: bool, refresh_drafts: bool) -> tuple[CommitSegment, ChunkCarry | None]:  # fmt: skip
    """One request's commit segment and the carry it leaves. Rows (h_p, t_{p+1}) run from the carried rows
    (or start) through start + n - 2 + a, plus the tail p = base-1 when no depth 0 writes it this step."""
    req, carry, n = s.req, s.req.spec.carry, s.num_new_tokens
    if carry is not None and carry.end != s.start:
        raise ValueError(f"chunk carry of {req.req_id} is for positions {carry.position}..{carry.end - 1}, "
                         f"but the next chunk starts at {s.start}")  # fmt: skip
    base = s.start + n + a
    tail = main_hidden[off + n - 1 + a : off + n + a]  # h_{base-1}
    if defer:  # this step has no other row (n - 1 + a == 0): hold h_{base-1} with the earlier carried rows
        rows = tail.copy() if carry is None else np.concatenate([carry.hidden, tail])
        return CommitSegment(s.start, main_hidden[:0], []), ChunkCarry(base - len(rows), rows)
    fold = s.reaches_end and draft_depths == 0  # write the tail now, paired with the new base token
    if not s.reaches_end:
        new_carry: ChunkCarry | None = ChunkCarry(base - 1, tail.copy())  # the seam row of the next chunk
    else:
        new_carry = None
    if s.num_drafts and not refresh_drafts:  # ablation: no refresh of the accepted drafts' entries
        if not fold:
            return CommitSegment(s.start, main_hidden[:0], []), new_carry
        assert next_token is not None
        return CommitSegment(base - 1, tail, [next_token]), new_carry
    first_p = s.start if carry is None else carry.position
    num_regular = n - 1 + a  # p = start .. start + n - 2 + a
    parts = ([] if carry is None else [carry.hidden]) + [main_hidden[off : off + num_regular]] + ([tail] if fold else [])
    hidden = np.concatenate(parts) if len(parts) > 1 else parts[0]
    # t_{p+1} for every row: committed tokens, then (decode) the accepted drafts; no full-list copy
    end = s.start + num_regular + 1
    tokens = req.token_ids[first_p + 1 : end] + req.spec.drafts[: max(0, end - req.num_tokens)]
    if fold:
        assert next_token is not None
        tokens.append(next_token)
    if len(tokens) != hidden.shape[0]:
        raise ValueError(f"commit plan mismatch for {req.req_id}: {hidden.shape[0]} hiddens vs {len(tokens)} tokens")
    return CommitSegment(first_p, hidden, tokens), new_carry


def pack_commits(segments: list[CommitSegment], block_tables: np.ndarray, hidden_size: int,
                 max_rows: int | None = None) -> list[CommitInput]:
    """The commit calls of a step: consecutive requests grouped so each call has at most max_rows rows (None:
    one call). A request's segment is never split (its rows are one contiguous KV write); one larger than
    max_rows still gets a call of its own, which the executor refuses with its one-line limit error."""
    groups: list[list[int]] = [[]]
    rows = 0
    for i, seg in enumerate(segments):
        n = len(seg.token_ids)
        if max_rows is not None and groups[-1] and rows + n > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += n
    if len(groups) == 1:
        return [pack_commit(segments, block_tables, hidden_size)]
    return [pack_commit([segments[i] for i in g], block_tables[g], hidden_size) for g in groups
            if any(segments[i].token_ids for i in g)]  # fmt: skip


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
        depth=depth,
    )


def plan_fused_draft(hidden: np.ndarray, token_ids: list[int], bases: list[int], block_tables: np.ndarray,
                     k_i: list[int]) -> FusedDraftInput:  # fmt: skip
    """The k depths in one call (builder/fused_draft.py): depth 0's rows, plus each row's depth count k_i."""
    d = plan_draft(hidden, token_ids, bases, 0, block_tables)
    return FusedDraftInput(d.hidden_in, d.token_ids, d.positions, d.counts, d.block_tables, np.asarray(k_i, np.int64))


# Dummy forwards of an idle lockstep rank: one padded row (count 0, null block) joins the MoE exchange and reads
# and writes no KV, so every rank issues the same collective-bearing forwards (invariant 9).
def _null_table(width: int) -> np.ndarray:
    table = np.full((1, width), -1, dtype=np.int32)
    table[0, 0] = NULL_BLOCK_ID
    return table


def plan_idle_main(width: int) -> MainInput:
    zero_i32, zero_i64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
    return MainInput(zero_i64, zero_i64, zero_i32, zero_i32, _null_table(width), np.zeros(0, np.int64))


def plan_idle_draft(hidden_size: int, width: int) -> DraftInput:
    zero_i32, zero_i64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
    return DraftInput(np.zeros((1, hidden_size), np.float32), zero_i64, zero_i64, zero_i32, _null_table(width))


def step_sample(scheduled: list[ScheduledRequest], accepted: list[int], errors: list[str | None], k_max: int,
                max_seq_len: int, cycle: tuple[float, float, float, float]) -> StepSample:  # fmt: skip
    """The draft-length controller's decision inputs from one verify step: per depth, how often it was reached and
    accepted, and how many tokens each request may still emit (runtime/core/draft_length.py)."""
    trials, successes, remaining = [0.0] * k_max, [0.0] * k_max, [0.0] * (k_max + 1)
    for s, a, err in zip(scheduled, accepted, errors, strict=True):
        if err is not None or not s.reaches_end or not s.req.spec.may_draft:
            continue
        for j in range(min(s.num_drafts, k_max)):  # depth j is reached when 0..j-1 were accepted
            trials[j] += a >= j
            successes[j] += a > j
        req = s.req  # tokens it may emit after this step's a + 1 (0: it finishes now and drafts nothing)
        left = min(req.params.max_tokens - req.num_output_tokens, max_seq_len - req.num_tokens) - a - 1
        if left > 0:
            remaining[min(left, k_max + 1) - 1] += 1
    return StepSample(*cycle, sum(remaining), float(sum(s.num_new_tokens for s in scheduled)), trials,
                      successes, remaining)  # fmt: skip


def verify_candidates(scheduled: list[ScheduledRequest], accepted: list[int], errors: list[str | None],
                      max_seq_len: int) -> list[Candidate]:  # fmt: skip
    """After accept (--num-draft-tokens per-request, runtime/core/verify_lengths.py): folds this step's verify
    into each request's acceptance counts (their only writer), and returns its candidate for the next draft loop
    (remaining 0, hence k_i = 0, for a request that does not draft: a prefill chunk, an error, a frozen plane)."""
    out = []
    for s, a, err in zip(scheduled, accepted, errors, strict=True):
        req, remaining, verified = s.req, 0, None
        if err is None and s.reaches_end and req.spec.may_draft:
            if s.num_drafts:
                req.verify_counts.observe(s.num_drafts, a)
                verified = (s.num_drafts, a)
            left = min(req.params.max_tokens - req.num_output_tokens, max_seq_len - req.num_tokens)
            remaining = left - a - 1  # tokens it may emit after this step's a + 1
        out.append(Candidate(req.verify_counts, remaining, verified))
    return out
