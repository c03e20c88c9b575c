"""Recurrent-state slots of hybrid (Gated DeltaNet) models, beside the paged KV pool (docs/MODELS.md).

A GDN layer's state after position p cannot be rebuilt from a KV cache: it is carried. Every running request owns a
group of K+2 slots of the executor's state pool (models/gdn.py `GDNStatePool`), one of which (`current`) holds the
state after its last committed position. A main forward reads `current` and writes the state after each of its
last min(q, K+1) rows into the group's OTHER slots in turn (a verify step of 1+k rows: one state per row; a prefill
chunk: its last row is the one that matters). No row ever writes the slot the forward reads, so a parallel kernel
(one program per head) has no read-after-write race on it. After acceptance the request's new `current` is the slot
written by the row of its last committed position: rolling back rejected drafts is a choice of slot, never a
recompute of the prompt and never a host copy (vLLM's per-position state slots). A fresh sequence (first position
0) starts from zeros inside the op, so a slot's previous owner never leaks into it.

Torch-free: plain Python and numpy over slot ids; the executor owns the state tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from runtime.core.config import ConfigError, RuntimeConfig
from runtime.executors.base import HybridMainInput, MainInput

if TYPE_CHECKING:
    from runtime.core.mtp_plan import RequestUpdate
    from runtime.core.scheduler import ScheduledRequest


def hybrid_runtime_config(cfg: RuntimeConfig, executor: object) -> RuntimeConfig:
    """The engine's config for a hybrid model. Prefix caching is off: a cached prefix has its KV but not the GDN state
    after it. An executor with a state pool (the torch one) must hold max_batch x (K+2) slots."""
    capacity = getattr(getattr(executor, "state", None), "num_slots", None)
    need = cfg.max_batch * (cfg.num_draft_tokens + 2)
    if capacity is not None and capacity < need:
        raise ConfigError(f"the executor's recurrent-state pool has {capacity} slots but max_batch={cfg.max_batch} "
                          f"with num_draft_tokens={cfg.num_draft_tokens} needs {need}; create the executor with the "
                          "same max_batch and num_draft_tokens as the engine")  # fmt: skip
    if cfg.enable_prefix_caching:
        logging.getLogger(__name__).info("prefix caching is off for hybrid (Gated DeltaNet) models")
        cfg = dataclasses.replace(cfg, enable_prefix_caching=False)
    return cfg


def idle_input(inp: MainInput) -> HybridMainInput:
    """An idle lockstep rank's dummy main forward (padded rows only, runtime/core/mtp_plan.py `plan_idle_main`) as a
    hybrid model takes it: no slot read, none written, so the GDN layers leave the state pool untouched."""
    reads, writes = np.full(len(inp.q_counts), -1, np.int32), np.full(len(inp.input_ids), -1, np.int32)
    return HybridMainInput(inp.input_ids, inp.positions, inp.q_counts, inp.kv_lens, inp.block_tables, inp.logit_rows,
                           reads, writes)  # fmt: skip


@dataclass(slots=True)
class _Group:
    base: int  # first slot of the group
    current: int = 0  # index in the group of the slot holding the committed state
    written: dict[int, int] = field(default_factory=dict)  # this step: row index in the request -> group index


class StateSlots:
    """Slot groups of K+2 per running request, for at most `max_batch` requests at once."""

    def __init__(self, max_batch: int, num_draft_tokens: int) -> None:
        self.group_size = num_draft_tokens + 2  # the current slot + one per verify row (1 + K)
        self.num_slots = max_batch * self.group_size
        self._free = list(range(max_batch))[::-1]
        self._groups: dict[str, _Group] = {}

    def plan(self, req_ids: list[str], inp: MainInput) -> HybridMainInput:
        """`inp` plus the slot each request reads [R] and the slot each row writes [T] (groups assigned on first use)."""
        reads = np.full(len(req_ids), -1, dtype=np.int32)
        writes = np.full(len(inp.input_ids), -1, dtype=np.int32)
        row = 0
        for r, (req_id, q) in enumerate(zip(req_ids, inp.q_counts.tolist(), strict=True)):
            g = self._groups.get(req_id)
            if g is None:
                if not self._free:
                    raise RuntimeError("no free recurrent-state slot group: more running requests than max_batch")
                g = self._groups[req_id] = _Group(self._free.pop() * self.group_size)
            reads[r] = g.base + g.current
            m = min(q, self.group_size - 1)
            g.written = {}
            for i in range(m):  # the last m rows, into the slots after `current` (never `current` itself)
                slot = (g.current + 1 + i) % self.group_size
                g.written[q - m + i] = slot
                writes[row + q - m + i] = g.base + slot
            row += q
        return HybridMainInput(inp.input_ids, inp.positions, inp.q_counts, inp.kv_lens, inp.block_tables, inp.logit_rows,
                               reads, writes)  # fmt: skip

    def commit(self, scheduled: list[ScheduledRequest], updates: list[RequestUpdate]) -> None:
        """After acceptance, per request: the state after its position num_computed-1, written by this step, becomes
        `current` (requests already finished, hence freed, are skipped)."""
        for s, upd in zip(scheduled, updates, strict=True):
            req_id = s.req.req_id
            g = self._groups.get(req_id)
            if g is None:
                continue
            row = upd.num_computed - s.start - 1
            if row not in g.written:
                raise RuntimeError(f"request {req_id}: no state was stored for row {row} of this step (rows stored: "
                                   f"{sorted(g.written)}); the state slots and the plan disagree")  # fmt: skip
            g.current, g.written = g.written[row], {}

    def free(self, *req_ids: str) -> None:
        """Finished or preempted requests give their groups back (a recompute starts fresh from position 0)."""
        for req_id in req_ids:
            g = self._groups.pop(req_id, None)
            if g is not None:
                self._free.append(g.base // self.group_size)

    @property
    def num_free_groups(self) -> int:
        return len(self._free)
