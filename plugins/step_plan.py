"""Per-forward index plans for the CPU plugin ops: where each K/V row is stored, which slots each request reads.

Pure functions of the varlen metadata (counts, starts / kv_lens, block tables, block size); no pool access.
Every layer of a forward receives the same metadata, so the CPU ops (plugins/ops.py) compute a plan once
and look it up by the metadata's *content* for the other layers (`cached`). Content, not identity: the
ONNX Runtime Python ops receive fresh copies of their inputs at every node, and captured-execution buffers
are rewritten in place between forwards, so neither object identity nor a tensor's address names a plan.

Slots are flat indices into one plane's K (or V) viewed as [num_blocks * block_size, Hkv, D]:
slot = block * block_size + (position % block_size). The semantics are plugins/reference.py's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class WritePlan:
    """kv_write: source row `rows[i]` (packed K/V row) is stored at flat slot `slots[i]`, position `positions[i]`."""

    rows: torch.Tensor | None  # int64 [n] rows that store; None = rows 0..n-1 all store (the common case)
    slots: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n] write position of each stored row (K rope inside the op)
    written: int  # n
    total: int  # rows the segments hold (stored or not): sum(counts)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """paged_attention as one batched SDPA over R requests padded to Qmax queries and Lmax keys."""

    num_requests: int  # R
    q_max: int  # Qmax
    kv_max: int  # Lmax
    gather: torch.Tensor  # int64 [R * Lmax] flat slot of each (request, key position); padding reads slot 0
    mask: torch.Tensor | None  # bool [R, 1, Qmax, Lmax] (True = attend); None = nothing to mask
    q_rows: torch.Tensor | None  # int64 [R * Qmax] packed query row of each padded query; None = identity
    out_slots: torch.Tensor | None  # int64 [n] padded query slots that are real rows ...
    out_rows: torch.Tensor | None  # int64 [n] ... and the packed rows they go to; None = identity


def segment_rows(counts: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand (count, start) segments into per-row (request index, position), rows packed by request."""
    counts = counts.long()
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    first_row = torch.cumsum(counts, 0) - counts
    pos = starts.long()[req] + torch.arange(req.shape[0], device=counts.device) - first_row[req]
    return req, pos


def plan_write(counts: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> WritePlan:
    """Rows of a missing block (-1) or past the table store nothing (reference: kv_write_ref)."""
    req, pos = segment_rows(counts, starts)
    col = pos // block_size
    in_table = col < block_tables.shape[1]
    block = torch.full_like(pos, -1)
    block[in_table] = block_tables[req[in_table], col[in_table]].long()
    valid = block >= 0
    slots = block * block_size + pos % block_size
    if bool(valid.all()):
        return WritePlan(None, slots, pos, int(pos.shape[0]), int(pos.shape[0]))
    rows = torch.nonzero(valid).flatten()
    return WritePlan(rows, slots[rows], pos[rows], int(rows.shape[0]), int(pos.shape[0]))


def plan_attention(
    q_counts: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_rows: int
) -> AttentionPlan:
    """Query j of request r sits at kv_lens[r]-q_counts[r]+j and sees keys 0..that (reference: paged_attention_ref).

    Padded query slots and padded requests (q_count 0) get a harmless all-visible row or one dummy column
    (no NaN), and their outputs are dropped; rows past sum(q_counts) come back as zeros.
    """
    qc, kl = q_counts.long(), kv_lens.long()
    r, q_max, kv_max = int(qc.shape[0]), int(qc.max()), max(int(kl.max()), 1)
    pos = torch.arange(kv_max)
    kv_valid = pos[None, :] < kl[:, None]  # [R, Lmax]
    if (int(kl.max()) - 1) // block_size >= block_tables.shape[1]:
        raise ValueError(f"paged_attention: kv_lens up to {int(kl.max())} need more than the {block_tables.shape[1]} "
                         f"block-table columns given (block size {block_size}); pass wider block tables")  # fmt: skip
    cols = (pos // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))  # only padding key slots are clamped
    table = block_tables if block_tables.shape[1] else torch.zeros((r, 1), dtype=block_tables.dtype)
    blocks = torch.where(kv_valid, table[:, cols].long(), 0).clamp(min=0)
    gather = (blocks * block_size + pos % block_size).flatten()
    j = torch.arange(q_max)
    q_valid = j[None, :] < qc[:, None]  # [R, Qmax]
    q_pos = (kl - qc)[:, None] + j[None, :]
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]  # [R, Qmax, Lmax]
    mask |= ~q_valid[:, :, None]  # padded query slots see everything: no NaN row (output dropped)
    mask[:, :, 0] |= kv_valid.sum(1)[:, None] == 0  # requests with no keys: one dummy column (output dropped)
    rows = torch.where(q_valid, (torch.cumsum(qc, 0) - qc)[:, None] + j[None, :], 0).flatten()
    identity = bool(q_valid.all()) and r * q_max == num_rows
    flat_valid = q_valid.flatten()
    return AttentionPlan(
        num_requests=r, q_max=q_max, kv_max=kv_max, gather=gather,
        mask=None if bool(mask.all()) else mask[:, None],
        q_rows=None if identity else rows,
        out_slots=None if identity else torch.nonzero(flat_valid).flatten(),
        out_rows=None if identity else rows[flat_valid],
    )  # fmt: skip


def _key(*tensors: torch.Tensor) -> tuple:
    return tuple((t.dtype, tuple(t.shape), t.numpy().tobytes()) for t in tensors)


_CACHE: OrderedDict[tuple, object] = OrderedDict()
_CACHE_SIZE = 16  # a step uses a handful of plans (main write/read, commit, draft write/read per depth)


def cached(kind: str, make: Callable[[], P], extra: tuple, *tensors: torch.Tensor) -> P:
    """`make()`'s plan for this metadata content, computed at most once while it stays among the recent ones."""
    key = (kind, extra, *_key(*tensors))
    plan = _CACHE.get(key)
    if plan is None:
        plan = make()
        _CACHE[key] = plan
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return plan  # type: ignore[return-value]
