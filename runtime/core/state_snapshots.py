"""GDN state snapshots at block boundaries: what makes prefix caching work for hybrid models (docs/RUNTIME.md).

A cached prefix of a hybrid model needs, beside its KV blocks, the recurrent state after its last position. While a
request forwards real tokens (prompt rows, or a decode step's base token), the row that completes a block writes its
state (conv window + ssm) into a *snapshot slot*: extra slots of the same state pool, after the request groups, so a
snapshot is one `write_slots` entry of a forward the request runs anyway, never a copy. The snapshot is *pending*
(owned by its request) until the request publishes that block; it is then *cached*, keyed to the published block id
and hash, and lives as long as that block keeps its hash (an evicted or reused block drops it). A new request's hit is
cut back to the last reused block that has a snapshot, and its first forward reads that slot: a hit is a choice of
slot, never a recompute.

Which rows store one is the caller's choice (runtime/core/state_pool.py `StateSlots.plan`): the last block boundary
among a forward's prompt rows, a branch point, and every `snapshot interval` prompt tokens before them. Budget:
`num_slots` slots; a claim with none free evicts first a snapshot whose block lost its hash, then the least recently
used cached one. Slots a running request reads (its `current` state) are pinned and never evicted. Interval snapshots
are claimed with a share: a request holding `share` of them (pending or cached) replaces its own oldest, so one long
prompt keeps the snapshots nearest its end and never flushes the other prefixes' snapshots.

Torch-free and deterministic (the same calls give the same slots on every rank).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from runtime.core.block_pool import BlockPool


@dataclass(slots=True)
class _Pending:
    slot: int
    block_index: int  # block j of the request's table: the state after position (j+1)*B - 1


class StateSnapshots:
    """`num_slots` snapshot slots, absolute ids `first_slot .. first_slot + num_slots - 1` of the state pool."""

    def __init__(self, first_slot: int, num_slots: int, pool: BlockPool) -> None:
        self.first_slot, self.num_slots, self.pool = first_slot, num_slots, pool
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop() hands out the lowest
        self._pending: dict[str, list[_Pending]] = {}  # req_id -> its snapshots of blocks not yet published
        self._cached: OrderedDict[int, tuple[int, int]] = OrderedDict()  # block_id -> (slot, block hash); LRU first
        self._pins: dict[int, int] = {}  # slot -> requests whose current state it is
        self._interval: dict[str, list[int]] = {}  # req_id -> slots of its live interval snapshots, oldest first

    # ------------------------------------------------------------------ reading (prefix hits)
    def slot_of(self, block_id: int) -> int | None:
        """The snapshot after `block_id`'s last position, if the block still holds the content it was taken for."""
        entry = self._cached.get(block_id)
        if entry is None or self.pool.block_hash(block_id) != entry[1]:
            return None
        return entry[0]

    def usable_blocks(self, block_ids: list[int]) -> int:
        """How many leading blocks of a prefix hit a request can reuse: up to the last one with a snapshot."""
        n = len(block_ids)
        while n > 0 and self.slot_of(block_ids[n - 1]) is None:
            n -= 1
        return n

    def read(self, block_id: int) -> int:
        """A hit's first forward reads the snapshot of its last reused block: pinned until the request moves on."""
        slot = self.slot_of(block_id)
        if slot is None:
            raise RuntimeError(f"no state snapshot for block {block_id}: the prefix hit was not cut back to one")
        self._cached.move_to_end(block_id)  # most recently used: evicted last
        self.pin(slot)
        return slot

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        if not self.first_slot <= slot < self.first_slot + self.num_slots:
            return  # a request group's own slot
        left = self._pins.pop(slot) - 1
        if left:
            self._pins[slot] = left
        elif not self._is_live(slot):  # a pinned snapshot whose block lost its hash, or a pending one released
            self._free.append(slot)

    # ------------------------------------------------------------------ writing (the request's forward)
    def claim(self, req_id: str, block_index: int) -> int | None:
        """A slot for request `req_id`'s state after its block `block_index`; None when every slot is in use."""
        if any(p.block_index == block_index for p in self._pending.get(req_id, [])):
            return None  # taken by an earlier forward of this request (a recompute of the same block)
        if not self._free:
            self._evict_one()
        if not self._free:
            return None
        slot = self._free.pop()
        self._pending.setdefault(req_id, []).append(_Pending(slot, block_index))
        return slot

    def claim_interval(self, req_id: str, block_index: int, share: int) -> int | None:
        """`claim` for an interval snapshot: past `share` live ones the request's oldest unpinned one goes first."""
        mine = self._interval.setdefault(req_id, [])
        if len(mine) >= share:
            oldest = next((slot for slot in mine if slot not in self._pins), None)
            if oldest is None:
                return None
            self._drop_slot(oldest)
        slot = self.claim(req_id, block_index)
        if slot is not None:
            mine.append(slot)
        return slot

    def publish(self, req_id: str, block_hashes: list[int]) -> None:
        """After the request published its blocks (hashes of its blocks 0..len-1): each pending snapshot of a
        published block goes to the block that owns its hash (another request's copy when this one stayed private:
        the same tokens give the same state), unless that block has a snapshot already."""
        keep = []
        for p in self._pending.get(req_id, []):
            if p.block_index >= len(block_hashes):
                keep.append(p)
                continue
            found = self.pool.lookup(block_hashes[p.block_index])
            if found is not None and self.slot_of(found[0]) is None:
                self._drop_cached(found[0])  # a stale entry of that block (it lost an older hash)
                self._cached[found[0]] = (p.slot, block_hashes[p.block_index])
            else:
                self._release(p.slot)
        if keep:
            self._pending[req_id] = keep
        else:
            self._pending.pop(req_id, None)

    def free(self, req_id: str) -> None:
        """A finished or preempted request: its unpublished snapshots are of no use to anyone."""
        for p in self._pending.pop(req_id, []):
            self._release(p.slot)
        self._interval.pop(req_id, None)  # its cached ones stay, as any cached snapshot

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Slots a claim can take now: free ones plus cached snapshots nobody reads (evictable, as cached blocks)."""
        return len(self._free) + sum(1 for slot, _ in self._cached.values() if slot not in self._pins)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def assert_no_leaks(self) -> None:
        """Raise RuntimeError unless every slot is free or cached exactly once, with nothing pending or pinned."""
        pending = [p.slot for ps in self._pending.values() for p in ps]
        cached = [slot for slot, _ in self._cached.values()]
        if pending or self._pins or sorted(self._free + cached) != list(range(self.first_slot,
                                                                              self.first_slot + self.num_slots)):
            raise RuntimeError(f"state snapshot slots leaked: free {sorted(self._free)}, cached {sorted(cached)}, "
                               f"pending {pending}, pinned {self._pins}")  # fmt: skip

    # ------------------------------------------------------------------ helpers
    def _is_live(self, slot: int) -> bool:
        return any(s == slot for s, _ in self._cached.values()) or any(
            p.slot == slot for ps in self._pending.values() for p in ps)  # fmt: skip

    def _release(self, slot: int) -> None:
        """`slot` holds no snapshot any more (the one place a pending or cached snapshot ends)."""
        for slots in self._interval.values():
            if slot in slots:
                slots.remove(slot)
        if slot not in self._pins:
            self._free.append(slot)

    def _drop_slot(self, slot: int) -> None:
        """End the snapshot in `slot`, pending or cached."""
        for req_id, ps in self._pending.items():
            if any(p.slot == slot for p in ps):
                self._pending[req_id] = [p for p in ps if p.slot != slot]
                self._release(slot)
                return
        self._drop_cached(next(b for b, (s, _) in self._cached.items() if s == slot))

    def _drop_cached(self, block_id: int) -> None:
        entry = self._cached.pop(block_id, None)
        if entry is not None:
            self._release(entry[0])

    def _evict_one(self) -> None:
        """Free one slot: a snapshot whose block lost its hash first, else the least recently used cached one."""
        stale = [b for b, (slot, h) in self._cached.items() if self.pool.block_hash(b) != h and slot not in self._pins]
        lru = [b for b, (slot, _) in self._cached.items() if slot not in self._pins]
        victims = stale or lru
        if victims:
            self._drop_cached(victims[0])
