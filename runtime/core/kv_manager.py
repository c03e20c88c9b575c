"""KV cache manager: per-request block tables, prefix-cache hits under the MTP rule, lookahead growth.

Owns the mapping req_id -> block_table and the chained block hashes of each request. It asks the
`BlockPool` for blocks and reference counts and never touches device memory or the scheduler's token
counts. Callers (the scheduler) talk token counts; this module turns them into blocks.

Token/block layout of a request (block_size B = 4, `|` = block boundary)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 ...
    prefix hit  [shared] [ shared ][ given up ]            (3 blocks matched, the last is recomputed)
    committed   ........................ P0-1 | b d_0 .. d_{k-1} | lookahead for next step's drafts

MTP prefix rule (invariant 6, docs/RUNTIME.md): the MTP (draft) KV entry at a block's last position p pairs
`h_p` with token `t_{p+1}`, the *next* block's first token. Each published block therefore records that
token (`next_token_id`), and a matched block is reused as-is only when the prompt continues with the same
token. The first matched block that fails this (for a plain prompt repeat: the last matched block) is
given up: `num_cached_tokens = (m-1)*B`. With `mtp_cow=True` that block is kept and only its last
position is recomputed (`num_cached_tokens = m*B - 1`): it is copied into a private block (the executor
performs `pending_copies()` before the step) and the request's table points at the copy. The whole
prompt never matches: one position is always computed. (Only waiting requests look up, and a waiting
request never holds a chunk carry: preemption drops it.)

NOTE: the plain "give up the last matched block" rule is not enough on its own. Two requests may publish
the same content twice (the second copy stays private), so block j of a hit chain can come from a request
that continued differently from the one that published block j+1; checking `next_token_id` per block
covers that case, and also lets a follow-up turn reuse its last block when the continuation matches.

A request that stopped keeping its MTP plane (the per-request policy or `auto` settled on drafting nothing)
still publishes its blocks, marked main-only (`BlockPool.publish(draft_exact=False)`): a lookup for a request that
will not draft reuses them (`find_prefix(will_draft=False)`: the K = 0 rule), one that will draft stops before them.
Without that, a server whose policy settled on drafting nothing would lose its prefix hits.

Only verified tokens reach the cache: `publish_full_blocks` hashes blocks fully covered by committed
positions. A shared or published block is never written (tests/runtime/test_kv_manager.py checks each write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models.engine_format.layout import cdiv
from runtime.core.block_pool import BlockPool

ROOT_HASH = 0  # parent hash of block 0 (not hash(None): that differs between processes on Python 3.11)


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained content hash of one full block. Collisions are guarded by comparing stored tokens."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True)
class PrefixHit:
    """Result of `find_prefix`; hides the pool from the scheduler. Valid until the next allocate/free."""

    block_ids: list[int]  # cached blocks reused read-only, in position order
    block_hashes: list[int]  # hash of each entry of block_ids (re-checked by allocate: stale-hit guard)
    num_cached_tokens: int  # positions 0..num_cached_tokens-1 need no compute; prefill starts here
    num_prompt_tokens: int = 0  # length of the looked-up prompt (stats only)
    num_matched_blocks: int = 0  # full blocks whose tokens are cached, before the MTP next-token check
    cow_block_id: int | None = None  # mtp_cow: last matched block, copied into a private block
    cow_block_hash: int | None = None  # hash of cow_block_id (stale-hit guard)
    num_reusable_tokens: int = 0  # positions reusable by the MTP rule, before `usable_prefix` cut the hit back

    def source_block_ids(self) -> list[int]:
        """Every cached block the hit depends on (shared ones plus the copy-on-write source)."""
        return self.block_ids + ([] if self.cow_block_id is None else [self.cow_block_id])


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start-up; the runtime reports them per run (docs/ARCHITECTURE.md)."""

    num_requests: int = 0  # requests whose first allocation went through this manager
    num_queried_tokens: int = 0  # prompt tokens looked up via find_prefix and then allocated
    num_hit_tokens: int = 0  # positions served from the cache (sum of num_cached_tokens)
    num_given_up_tokens: int = 0  # matched positions recomputed anyway because of the MTP rule
    num_cow_copies: int = 0  # block copies requested by mtp_cow hits


@dataclass(slots=True)
class _PendingCopy:
    req_id: str  # request whose table points at dst_block_id
    src_block_id: int  # cached block, pinned (one extra ref) until complete_copies()
    dst_block_id: int  # private block of req_id


class KVCacheManager:
    """Per-request block tables over one `BlockPool` (main and MTP draft planes share the block ids)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 mtp_cow: bool = False, draft_kv: bool = True,
                 usable_prefix: Callable[[list[int]], int] | None = None) -> None:
        """
        Args:
            num_blocks: blocks in the pool, including the reserved null block 0.
            block_size: token slots per block (B).
            enable_prefix_caching: publish full verified blocks and look prompts up.
            mtp_cow: on a hit, recompute only the last matched token (copy-on-write of the last matched
                block) instead of giving up the whole last matched block.
            draft_kv: blocks also hold MTP draft entries (MTP on). Without them (K = 0) a matched block is
                reusable whatever token follows it, so the next-token rule below does not apply.
        """
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.mtp_cow = mtp_cow
        self.draft_kv = draft_kv
        self.usable_prefix = usable_prefix
        self.pool = BlockPool(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}  # req_id -> block_table
        self._block_hashes: dict[str, list[int]] = {}  # req_id -> hashes of its hashed prefix blocks
        self._pending: list[_PendingCopy] = []  # mtp_cow copies not yet performed by the executor
        self._cut_at: dict[str, int] = {}  # req_id -> where its hit was reusable up to, when usable_prefix cut it back

    # ------------------------------------------------------------------ prefix lookup
    def find_prefix(self, token_ids: Sequence[int], will_draft: bool = True) -> PrefixHit:
        """Longest cached prefix of full blocks usable by a new request; side-effect free.

        Args:
            token_ids: the prompt (or the full token list of a resumed request).
            will_draft: the request keeps its MTP plane (False: admitted without it, so only main KV is read and
                main-only blocks match too, as with K = 0).
        Returns:
            A `PrefixHit`; at least one position is always left to compute.
        """
        B = self.block_size
        draft_kv = self.draft_kv and will_draft
        matched: list[tuple[int, int, int | None]] = []  # (block_id, hash, next_token_id), content matches
        parent = ROOT_HASH
        if self.enable_prefix_caching:
            for j in range(len(token_ids) // B):
                tokens = tuple(token_ids[j * B:(j + 1) * B])
                block_hash = hash_block_tokens(parent, tokens)
                found = self.pool.lookup(block_hash)
                if found is None or found[1] != tokens:  # miss, or a hash collision
                    break
                if draft_kv and not self.pool.is_draft_exact(found[0]):  # its MTP entries were never written
                    break
                matched.append((found[0], block_hash, found[2]))
                parent = block_hash
        # A matched block is reusable as-is only if its last draft entry was paired with our next token.
        num_full = 0
        while (num_full < len(matched) and (num_full + 1) * B < len(token_ids)
               and (not draft_kv or matched[num_full][2] == token_ids[(num_full + 1) * B])):
            num_full += 1
        reusable = num_full * B
        if self.usable_prefix is not None:  # the cut happens after the MTP rule: it names the blocks really reused
            num_full = self.usable_prefix([m[0] for m in matched[:num_full]])
        hit = PrefixHit(block_ids=[m[0] for m in matched[:num_full]], block_hashes=[m[1] for m in matched[:num_full]],
                        num_cached_tokens=num_full * B, num_prompt_tokens=len(token_ids),
                        num_matched_blocks=len(matched), num_reusable_tokens=reusable)
        if self.mtp_cow and draft_kv and num_full < len(matched):  # main KV of the block fits, its last draft entry does not
            hit.cow_block_id, hit.cow_block_hash = matched[num_full][:2]
            hit.num_cached_tokens += B - 1
        return hit

    # ------------------------------------------------------------------ allocation
    def num_blocks_needed(self, req_id: str, num_tokens_needed: int, prefix: PrefixHit | None = None) -> int:
        """New blocks `allocate` would take from the pool (prefix blocks excluded, COW copy included)."""
        num_required = cdiv(num_tokens_needed, self.block_size)
        table = self._tables.get(req_id)
        if table is not None:
            if prefix is not None and prefix.source_block_ids():
                raise ValueError(f"request {req_id!r} already has blocks; pass a PrefixHit only on its first allocate")
            return max(0, num_required - len(table))
        if prefix is None:
            return num_required
        if num_tokens_needed <= prefix.num_cached_tokens:
            raise ValueError(f"num_tokens_needed={num_tokens_needed} must exceed the hit's num_cached_tokens="
                             f"{prefix.num_cached_tokens}: at least one position is computed")
        return num_required - len(prefix.block_ids)

    def can_allocate(self, req_id: str, num_tokens_needed: int, prefix: PrefixHit | None = None) -> bool:
        """Side-effect-free check that `allocate` with the same arguments would succeed."""
        num_new = self.num_blocks_needed(req_id, num_tokens_needed, prefix)
        # Free cached blocks of the hit leave the free queue when re-used, so they are not available as new.
        num_reused_free = 0
        if prefix is not None:
            self._check_hit_is_fresh(prefix)
            num_reused_free = sum(self.pool.is_free(b) for b in set(prefix.source_block_ids()))
        return num_new <= self.pool.num_free_blocks - num_reused_free

    def allocate(self, req_id: str, num_tokens_needed: int, prefix: PrefixHit | None = None) -> bool:
        """Make `req_id` own blocks covering positions 0..num_tokens_needed-1 (check-then-commit).

        The first call may pass the request's `PrefixHit`; its blocks are shared (incref). Later calls
        grow the table, e.g. to reserve lookahead slots for MTP drafts (positions up to P0 + 2k).

        Returns:
            False, with no state change, when the pool cannot supply the blocks.
        """
        if not self.can_allocate(req_id, num_tokens_needed, prefix):
            return False
        num_new = self.num_blocks_needed(req_id, num_tokens_needed, prefix)
        is_new_request = req_id not in self._tables
        if is_new_request and prefix is not None:
            self.pool.incref(prefix.source_block_ids())  # first, so that allocate() cannot evict them
        new_blocks = self.pool.allocate(num_new)
        assert new_blocks is not None  # guaranteed by can_allocate
        if not is_new_request:
            self._tables[req_id].extend(new_blocks)
            return True
        self._tables[req_id] = (list(prefix.block_ids) if prefix else []) + new_blocks
        self._block_hashes[req_id] = list(prefix.block_hashes) if prefix else []
        self.stats.num_requests += 1
        if prefix is not None:
            self._record_hit(req_id, prefix, new_blocks)
        return True

    def _record_hit(self, req_id: str, prefix: PrefixHit, new_blocks: list[int]) -> None:
        self.stats.num_queried_tokens += prefix.num_prompt_tokens
        self.stats.num_hit_tokens += prefix.num_cached_tokens
        self.stats.num_given_up_tokens += prefix.num_matched_blocks * self.block_size - prefix.num_cached_tokens
        if prefix.num_reusable_tokens > prefix.num_cached_tokens:
            self._cut_at[req_id] = prefix.num_reusable_tokens
        if prefix.cow_block_id is not None:  # the src keeps the extra ref from incref until complete_copies()
            self._pending.append(_PendingCopy(req_id, prefix.cow_block_id, new_blocks[0]))
            self.stats.num_cow_copies += 1

    def _check_hit_is_fresh(self, prefix: PrefixHit) -> None:
        pairs: list[tuple[int, int | None]] = list(zip(prefix.block_ids, prefix.block_hashes, strict=True))
        if prefix.cow_block_id is not None:
            pairs.append((prefix.cow_block_id, prefix.cow_block_hash))
        for block_id, block_hash in pairs:
            if self.pool.block_hash(block_id) != block_hash:
                raise ValueError(f"stale PrefixHit: block {block_id} was evicted since find_prefix; look up again")

    # ------------------------------------------------------------------ release
    def free(self, req_id: str) -> None:
        """Release every block of a finished or preempted request, tail first (tails evict first)."""
        table = self._tables.pop(req_id)
        del self._block_hashes[req_id]
        self._cut_at.pop(req_id, None)
        mine = [c for c in self._pending if c.req_id == req_id]
        self._pending = [c for c in self._pending if c.req_id != req_id]
        self.pool.free(reversed(table))
        self.pool.free(c.src_block_id for c in mine)

    def pending_copies(self) -> list[tuple[int, int]]:
        """(src_block, dst_block) copies (main and draft planes) the executor must do before the next step."""
        return [(c.src_block_id, c.dst_block_id) for c in self._pending]

    def complete_copies(self) -> None:
        """The executor performed `pending_copies()`: unpin the sources."""
        pending, self._pending = self._pending, []
        self.pool.free(c.src_block_id for c in pending)

    # ------------------------------------------------------------------ prefix publication
    def publish_full_blocks(self, req_id: str, token_ids: Sequence[int], num_committed: int,
                            num_main_committed: int | None = None) -> int:  # fmt: skip
        """Hash and publish every block fully covered by positions 0..num_committed-1 (and, main-only, those
        covered by 0..num_main_committed-1).

        Args:
            token_ids: the request's tokens (prompt + outputs), at least num_committed of them.
            num_committed: positions whose main AND draft KV are final (verified tokens only; for a prefill
                chunk whose last hidden is carried, the chunk's last position is not final yet).
            num_main_committed: a request that no longer keeps its MTP plane: positions whose main KV is final;
                the blocks past num_committed are published main-only (their MTP entries never become final).
        Returns:
            The number of blocks newly hashed.
        """
        if not self.enable_prefix_caching:
            return 0
        B = self.block_size
        table, hashes = self._tables[req_id], self._block_hashes[req_id]
        end = max(num_committed, num_main_committed or 0)
        if end > len(token_ids) or cdiv(end, B) > len(table):
            raise ValueError(f"num_committed={end} exceeds the tokens ({len(token_ids)}) or the blocks "
                             f"({len(table)}) of request {req_id!r}")
        parent = hashes[-1] if hashes else ROOT_HASH
        start = len(hashes)
        # Block j needs token (j+1)*B too: its last draft entry was paired with it (see find_prefix).
        for j in range(start, min(end // B, (len(token_ids) - 1) // B)):
            tokens = token_ids[j * B:(j + 1) * B]
            parent = hash_block_tokens(parent, tokens)
            # False when another block holds this content already; this one then stays private.
            self.pool.publish(table[j], parent, tokens, next_token_id=token_ids[(j + 1) * B],
                              draft_exact=(j + 1) * B <= num_committed)  # fmt: skip
            hashes.append(parent)
        return len(hashes) - start

    # ------------------------------------------------------------------ queries
    def block_table(self, req_id: str) -> list[int]:
        return list(self._tables[req_id])

    def cut_at(self, req_id: str) -> int | None:
        """Where the request's prefix hit could have ended had `usable_prefix` not cut it back (a branch point that
        later requests will likely share: hybrid models snapshot their state there), or None."""
        return self._cut_at.get(req_id)

    def block_hashes(self, req_id: str) -> list[int]:
        """Hashes of the request's blocks 0.. that are published (or reused from the cache), in order."""
        return list(self._block_hashes[req_id])

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests or pinned as copy sources (the null block excluded)."""
        return self.pool.num_used_blocks

    def assert_no_leaks(self) -> None:
        """Raise RuntimeError unless every reference count equals the holders the manager knows about."""
        expected = [0] * self.num_blocks
        expected[0] = 1  # the null block holds itself
        for table in self._tables.values():
            for block_id in table:
                expected[block_id] += 1
        for copy in self._pending:
            expected[copy.src_block_id] += 1
        actual = [self.pool.ref_count(b) for b in range(self.num_blocks)]
        bad = {b: (actual[b], expected[b]) for b in range(self.num_blocks) if actual[b] != expected[b]}
        if bad:
            raise RuntimeError(f"block reference counts disagree with block tables (block: (actual, expected)): {bad}")
        if self.pool.num_free_blocks != sum(1 for b in range(1, self.num_blocks) if expected[b] == 0):
            raise RuntimeError("free queues disagree with reference counts")
