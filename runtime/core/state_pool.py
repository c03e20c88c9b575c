"""Recurrent-state slots of hybrid (Gated DeltaNet) models, beside the paged KV pool (docs/MODELS.md).

A GDN layer's state after position p cannot be rebuilt from a KV cache: it is carried. Every running request owns a
group of K+2 slots of the executor's state pool (models/gdn.py `GDNStatePool`), one of which (`current`) holds the
state after its last committed position. A main forward reads `current` and writes the state after each of its
last min(q, K+1) rows into the group's OTHER slots in turn (a verify step of 1+k rows: one state per row; a prefill
chunk: its last row is the one that matters). No row ever writes the slot the forward reads, so a parallel kernel
(one program per head) has no read-after-write race on it. After acceptance the request's new `current` is the slot
written by the row of its last committed position: rolling back rejected drafts is a choice of slot, never a
recompute of the prompt and never a host copy (vLLM's per-position state slots). A fresh sequence (first position
0) starts from zeros inside the op, so a slot's previous owner never leaks into it. With prefix caching, `current` may
also be a state snapshot's slot (a hit resumes from one, runtime/core/state_snapshots.py), read but never written.

Torch-free: plain Python and numpy over slot ids; the executor owns the state tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.state_snapshots import StateSnapshots
from runtime.executors.base import HybridMainInput, MainInput

if TYPE_CHECKING:
    from runtime.core.kv_manager import KVCacheManager
    from runtime.core.mtp_plan import RequestUpdate
    from runtime.core.scheduler import ScheduledRequest


def hybrid_runtime_config(cfg: RuntimeConfig, executor: object) -> RuntimeConfig:
    """The engine's config for a hybrid model. An executor with a state pool must hold max_batch x (K+2) slots; the
    slots past those (at most `num_state_snapshots`) hold the state snapshots prefix caching needs
    (runtime/core/state_snapshots.py). With none to spare, prefix caching is off; copy-on-write hits always are (they
    resume mid-block, where no snapshot is taken)."""
    capacity = getattr(getattr(executor, "state", None), "num_slots", None)
    need = cfg.max_batch * (cfg.num_draft_tokens + 2)
    if capacity is not None and capacity < need:
        raise ConfigError(f"the executor's recurrent-state pool has {capacity} slots but max_batch={cfg.max_batch} "
                          f"with num_draft_tokens={cfg.num_draft_tokens} needs {need}; create the executor with the "
                          "same max_batch and num_draft_tokens as the engine")  # fmt: skip
    log = logging.getLogger(__name__)
    spare = 0 if capacity is None else min(capacity - need, cfg.state_snapshot_slots)
    if cfg.enable_prefix_caching and spare == 0:
        log.info("prefix caching is off for this hybrid (Gated DeltaNet) model: no state snapshot slot")
        return dataclasses.replace(cfg, enable_prefix_caching=False, num_state_snapshots=0)
    if cfg.prefix_cache_cow:  # a copy-on-write hit resumes mid-block, where no snapshot is taken
        log.info("prefix_cache_cow is off for hybrid (Gated DeltaNet) models: snapshots sit at block boundaries")
        cfg = dataclasses.replace(cfg, prefix_cache_cow=False)
    return dataclasses.replace(cfg, num_state_snapshots=spare if cfg.enable_prefix_caching else 0)


def idle_input(inp: MainInput) -> HybridMainInput:
    """An idle lockstep rank's dummy main forward (padded rows only, runtime/core/mtp_plan.py `plan_idle_main`) as a
    hybrid model takes it: no slot read, none written, so the GDN layers leave the state pool untouched."""
    reads, writes = np.full(len(inp.q_counts), -1, np.int32), np.full(len(inp.input_ids), -1, np.int32)
    return HybridMainInput(inp.input_ids, inp.positions, inp.q_counts, inp.kv_lens, inp.block_tables, inp.logit_rows,
                           reads, writes)  # fmt: skip


@dataclass(slots=True)
class _Group:
    base: int  # first slot of the group
    current: int  # absolute slot holding the committed state: one of the group's, or a state snapshot's
    written: dict[int, int] = field(default_factory=dict)  # this step: row index in the request -> absolute slot


class StateSlots:
    """Slot groups of K+2 per running request, for at most `max_batch` requests at once, and (with prefix caching) the
    state snapshots after them: slots max_batch x (K+2) onwards (runtime/core/state_snapshots.py)."""

    def __init__(self, max_batch: int, num_draft_tokens: int, kv: KVCacheManager | None = None,
                 num_snapshots: int = 0, snapshot_interval: int = 0) -> None:  # fmt: skip
        self.group_size = num_draft_tokens + 2  # the current slot + one per verify row (1 + K)
        self.num_group_slots = max_batch * self.group_size
        self._free = list(range(max_batch))[::-1]
        self._groups: dict[str, _Group] = {}
        self.kv = kv
        self.snapshots = StateSnapshots(self.num_group_slots, num_snapshots, kv.pool) if kv and num_snapshots else None
        self.num_slots = self.num_group_slots + num_snapshots
        self.snapshot_interval = snapshot_interval
        self.interval_share = max(1, num_snapshots // max_batch)  # interval snapshots one request keeps at most

    @classmethod
    def for_engine(cls, cfg: RuntimeConfig, kv: KVCacheManager) -> StateSlots:
        """The engine's slots: `cfg` as `hybrid_runtime_config` returned it (its snapshot count decided)."""
        return cls(cfg.max_batch, cfg.num_draft_tokens, kv, cfg.num_state_snapshots or 0, cfg.snapshot_interval)

    def usable_prefix(self, block_ids: list[int]) -> int:
        """A prefix hit's reusable blocks, cut back to the last one with a state snapshot (KVCacheManager's hook)."""
        return self.snapshots.usable_blocks(block_ids) if self.snapshots is not None else 0

    def plan(self, scheduled: list[ScheduledRequest], inp: MainInput) -> HybridMainInput:
        """`inp` plus the slot each request reads [R] and the slot each row writes [T]: its group's slots for the last
        rows (never the slot it reads, so a parallel kernel has no read-after-write race), and snapshot slots
        (`_claim_snapshots`). Groups are assigned on first use; a request resuming from a prefix hit reads the
        snapshot of its last cached block (pinned before any claim below)."""
        reads = np.full(len(scheduled), -1, dtype=np.int32)
        writes = np.full(len(inp.input_ids), -1, dtype=np.int32)
        for r, s in enumerate(scheduled):
            reads[r] = self._group(s).current
        snapshots = self._claim_snapshots(scheduled)
        row = 0
        for s, q, snapshot_rows in zip(scheduled, inp.q_counts.tolist(), snapshots, strict=True):
            g = self._groups[s.req.req_id]
            m = min(q, self.group_size - 1)
            free = [g.base + (g.current - g.base + 1 + i) % self.group_size for i in range(self.group_size)]
            free = [slot for slot in free if slot != g.current]  # g.current outside the group (a snapshot): all G
            g.written = {q - m + i: free[i] for i in range(m)}  # the last m rows, into the slots after `current`
            g.written |= snapshot_rows  # a row that is both stores only its snapshot (read from there)
            for i, slot in g.written.items():
                writes[row + i] = slot
            row += q
        return HybridMainInput(inp.input_ids, inp.positions, inp.q_counts, inp.kv_lens, inp.block_tables, inp.logit_rows,
                               reads, writes)  # fmt: skip

    def _group(self, s: ScheduledRequest) -> _Group:
        g = self._groups.get(s.req.req_id)
        if g is not None:
            return g
        if not self._free:
            raise RuntimeError("no free recurrent-state slot group: more running requests than max_batch")
        base = self._free.pop() * self.group_size
        current = base  # a fresh sequence (position 0): the op starts from zeros and reads nothing
        if s.start > 0:  # a prefix hit: the state after position start-1 is the snapshot of the block ending there
            assert self.kv is not None and self.snapshots is not None, "a prefix hit without state snapshots"
            block_id = self.kv.block_table(s.req.req_id)[s.start // self.kv.block_size - 1]
            current = self.snapshots.read(block_id)
        g = self._groups[s.req.req_id] = _Group(base, current)
        return g

    def _claim_snapshots(self, scheduled: list[ScheduledRequest]) -> list[dict[int, int]]:
        """Per request, the rows of this forward that store a state snapshot -> their slots. First, for every request,
        the last of its prompt rows that completes a block and the end of the prefix its hit was cut back from (a
        branch point: the next request sharing it then hits it whole); then the rows every `snapshot_interval` prompt
        tokens (so a later prompt sharing only part of this one resumes near the end of the shared part), each request
        keeping at most `interval_share` of those: one long prompt never takes the slot another request's last boundary
        needs, nor flushes the cache. Decode steps take none: they would churn the budget the prompts' snapshots need."""
        rows: list[dict[int, int]] = [{} for _ in scheduled]
        if self.snapshots is None or self.kv is None:
            return rows
        b, every = self.kv.block_size, self.snapshot_interval
        at_intervals = []
        for r, s in enumerate(scheduled):
            end = s.start + s.num_new_tokens  # real rows: s.start .. end-1 (drafts after them)
            prompt_end = min(end, s.req.num_prompt_tokens)
            last = {prompt_end // b * b - 1, (self.kv.cut_at(s.req.req_id) or 0) - 1}
            for p in sorted(p for p in last if s.start <= p < end):
                self._store(rows[r], s, p, self.snapshots.claim(s.req.req_id, p // b))
            if every:
                first = (s.start // every + 1) * every - 1  # the first position p >= s.start with (p + 1) % every == 0
                # at most its share per forward: a claim past it replaces a snapshot of an earlier forward, never a
                # row of this one (whose slot would then be written twice)
                mine = [p for p in range(first, prompt_end, every) if p not in last][-self.interval_share :]
                at_intervals += [(r, s, p) for p in mine]
        for r, s, p in at_intervals:
            self._store(rows[r], s, p, self.snapshots.claim_interval(s.req.req_id, p // b, self.interval_share))
        return rows

    @staticmethod
    def _store(rows: dict[int, int], s: ScheduledRequest, position: int, slot: int | None) -> None:
        if slot is not None:
            rows[position - s.start] = slot

    def commit(self, scheduled: list[ScheduledRequest], updates: list[RequestUpdate]) -> None:
        """After acceptance, per request: the state after its position num_computed-1, written by this step, becomes
        `current` (requests already finished, hence freed, are skipped). A snapshot slot becoming current is pinned."""
        for s, upd in zip(scheduled, updates, strict=True):
            req_id = s.req.req_id
            g = self._groups.get(req_id)
            if g is None:
                continue
            row = upd.num_computed - s.start - 1
            if row not in g.written:
                raise RuntimeError(f"request {req_id}: no state was stored for row {row} of this step (rows stored: "
                                   f"{sorted(g.written)}); the state slots and the plan disagree")  # fmt: skip
            self._set_current(g, g.written[row])
            g.written = {}

    def _set_current(self, g: _Group, slot: int) -> None:
        if self.snapshots is not None and slot != g.current:
            if slot >= self.num_group_slots:
                self.snapshots.pin(slot)
            self.snapshots.unpin(g.current)
        g.current = slot

    def published(self, req_id: str) -> None:
        """The request published blocks: its pending snapshots of them become cached (runtime/core/state_snapshots.py)."""
        if self.snapshots is not None and self.kv is not None and self.kv.has_request(req_id):
            self.snapshots.publish(req_id, self.kv.block_hashes(req_id))

    def free(self, *req_ids: str) -> None:
        """Finished or preempted requests give their groups back (a recompute starts fresh from position 0, or from a
        prefix hit) and their unpublished snapshots."""
        for req_id in req_ids:
            g = self._groups.pop(req_id, None)
            if g is not None:
                self._free.append(g.base // self.group_size)
                if self.snapshots is not None:
                    self.snapshots.unpin(g.current)
            if self.snapshots is not None:
                self.snapshots.free(req_id)

    @property
    def num_free_groups(self) -> int:
        return len(self._free)
