"""Scheduler: which requests run this step and how many tokens each forwards.

Continuous batching under a token budget (`max_num_tokens`) and a request limit (`max_batch`).
Running requests go first (decode rows are 1 + k tokens, never split), then waiting ones (prefill,
chunked to fit; at most one partial chunk per step). Blocks come from the KV manager with lookahead
so every write of this step, including the k draft depths, lands in a block the request owns
(invariant 8). When blocks run out, the newest running request is preempted: its blocks are freed
and it is re-prefilled later from its tokens (nothing emitted is lost or repeated).

Torch-free: plain Python over ints and lists.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.core.config import RuntimeConfig
from runtime.core.kv_manager import KVCacheManager
from runtime.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    req: Request
    start: int  # first position forwarded (= req.num_computed at schedule time)
    num_new_tokens: int  # real tokens forwarded: token_ids[start : start + num_new_tokens]
    num_drafts: int  # drafts appended after them (0 unless the chunk reaches the end)

    @property
    def reaches_end(self) -> bool:
        """This forward covers the last token, so it samples/verifies and (with MTP) drafts."""
        return self.start + self.num_new_tokens == self.req.num_tokens

    @property
    def num_rows(self) -> int:
        return self.num_new_tokens + self.num_drafts


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the step


class Scheduler:
    def __init__(self, cfg: RuntimeConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Asked once per admission, before its prefix lookup: whether the request keeps its MTP plane (None: all
        # do). The per-request policy's `keeps_mtp_plane`, once settled on drafting nothing (verify_lengths.py).
        self.keeps_mtp_plane: Callable[[], bool] | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def lookahead_tokens(self, req: Request, start: int, n_new: int, n_drafts: int) -> int:
        """Positions the request must own for this step: its forward, then the k draft depths.

        Depth d writes MTP KV at base-1+d with base <= num_tokens + n_drafts, so the last draft write is
        below num_tokens + n_drafts + k - 1. k is the configured (maximum) draft length: a step that drafts
        fewer (`--num-draft-tokens auto`) writes a subset of these positions; a request whose MTP plane is
        frozen (auto gave up drafting) never drafts again and needs none.
        """
        if start + n_new < req.num_tokens:
            return start + n_new
        k = self.cfg.num_draft_tokens if req.spec.may_draft else 0
        return req.num_tokens + n_drafts + max(k - 1, 0)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_tokens
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            s = self._schedule_running(req, budget, out)
            if s is not None:
                out.scheduled.append(s)
                budget -= s.num_rows
        self._schedule_waiting(budget, out)
        out.block_copies = self.kv.pending_copies()  # prefix-cache copy-on-write, done before the forward
        return out

    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        remaining = req.num_tokens - req.num_computed
        n_drafts = len(req.spec.drafts)
        if n_drafts == 0:  # a chunking prefill (or a K=0 decode row) continues with what fits
            n_new = min(remaining, budget, self.cfg.max_prefill_chunk)
        elif remaining + n_drafts <= budget:
            n_new = remaining
        else:
            n_new = 0  # a decode row (1 + k tokens) is never split; wait for the next step
        if n_new <= 0:
            return None
        need = self.lookahead_tokens(req, req.num_computed, n_new, n_drafts)
        while not self.kv.allocate(req.req_id, need):
            victim = max((r for r in self.running if r.status == RequestStatus.RUNNING), key=lambda r: r.arrival)
            self.preempt(victim, out)
            if victim is req:
                return None
        return ScheduledRequest(req, req.num_computed, n_new, n_drafts)

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        has_partial = any(not s.reaches_end for s in out.scheduled)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_batch:
            req = self.waiting[0]
            # prompt logprobs need every prompt position computed: no prefix-cache read (as vLLM)
            cached = self.cfg.enable_prefix_caching and req.params.prompt_logprobs is None
            keeps = req.spec.may_draft and (self.keeps_mtp_plane is None or self.keeps_mtp_plane())
            hit = self.kv.find_prefix(req.token_ids, will_draft=keeps) if cached else None
            start = hit.num_cached_tokens if hit is not None else 0
            if not keeps:  # no prompt commit, no drafts: the blocks it publishes from start on are main-only
                req.spec.mtp_frozen_at = start
            remaining = req.num_tokens - start
            n_new = min(remaining, budget, self.cfg.max_prefill_chunk)
            if n_new < remaining and has_partial:
                break  # one partial (chunked) prefill in flight per step
            need = self.lookahead_tokens(req, start, n_new, 0)
            if not self.kv.allocate(req.req_id, need, hit):
                break
            self.waiting.popleft()
            if hit is not None:
                req.num_cached_tokens = start
            req.num_computed = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            s = ScheduledRequest(req, start, n_new, 0)
            out.scheduled.append(s)
            budget -= n_new
            has_partial = has_partial or not s.reaches_end

    def preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req.req_id)
        self.running.remove(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Release a finished (or aborted) request's blocks and forget it."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.kv.has_request(req.req_id):
            self.kv.free(req.req_id)
