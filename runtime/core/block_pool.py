"""Block pool: owns every KV block of the paged pool, its reference count and its prefix-cache identity.

The pool is the bottom of the control-plane layer stack (engine -> scheduler -> KV manager -> block pool).
It knows nothing about requests or tokens positions; it hands out block ids, counts references, keeps the
hash -> block map of published (full, verified) blocks and decides which cached block to evict.
It must not touch device memory; a block id is just an index into the executor's paged KV tensors
(main plane and MTP draft plane share the same ids).

Layout of the free blocks (both queues hold only blocks with ``ref_count == 0``)::

    uncached free queue (FIFO)   : never-published blocks, handed out first
    cached free queue (LRU order): published blocks nobody holds; head = least recently freed = evicted first

Block 0 is the reserved null block: never handed out, never freed. Padded rows of the per-step metadata
and idle-rank dummy forwards point at it, so a stray write there corrupts nobody's KV.

NOTE: vLLM keeps a single free queue; we keep uncached blocks apart so a free uncached block is always
used before any cached prefix is evicted. Both orders are deterministic, so tests assert exact block ids.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NULL_BLOCK_ID = 0


class BlockPoolError(RuntimeError):
    """An invariant of the pool was broken (double free, negative reference count, conflicting hash)."""


@dataclass(slots=True)
class KVBlock:
    """Book-keeping of one block. Only `BlockPool` may change these fields."""

    block_id: int  # index into the paged KV tensors of every layer (main and MTP planes)
    ref_count: int = 0  # number of block tables (plus pinned copy sources) holding the block
    block_hash: int | None = None  # chained content hash, set once when published; None while private
    token_ids: tuple[int, ...] | None = None  # tokens of a published block, compared on lookup (collision guard)
    next_token_id: int | None = None  # token the MTP draft KV at the block's last position was paired with
    draft_exact: bool = True  # its MTP draft entries are final too (False: main KV only; see `publish`)
    num_hits: int = 0  # times the block was re-used after publication (reset on eviction)


class BlockPool:
    """Fixed set of `num_blocks` blocks of `block_size` token slots each; block 0 is the null block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_count = 1  # permanently held, so it is never free nor evictable
        self._uncached_free: deque[int] = deque(range(1, num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: head is evicted first
        self._hash_to_block: dict[int, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now (free uncached + evictable cached)."""
        return len(self._uncached_free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a published prefix (evicted LRU-first)."""
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by somebody, the null block excluded."""
        return self.num_blocks - 1 - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id).ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self._block(block_id).block_hash

    def is_published(self, block_id: int) -> bool:
        """Published blocks are frozen: their content is reachable by any future prefix lookup."""
        return self._block(block_id).block_hash is not None

    def is_shared(self, block_id: int) -> bool:
        """True when more than one holder exists now, or the block was published and re-used by a hit."""
        block = self._block(block_id)
        return block.ref_count > 1 or (block.block_hash is not None and block.num_hits > 0)

    def is_free(self, block_id: int) -> bool:
        return self._block(block_id).ref_count == 0

    def is_draft_exact(self, block_id: int) -> bool:
        """A published block's MTP draft entries are final too (a lookup that will draft may reuse it)."""
        return self._block(block_id).draft_exact

    def lookup(self, block_hash: int) -> tuple[int, tuple[int, ...], int | None] | None:
        """Return (block_id, token_ids, next_token_id) of the block published with this hash, or None.

        No side effects; the caller compares token_ids (hash collisions) and next_token_id (MTP draft entry).
        """
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        assert block.token_ids is not None  # published blocks always carry their tokens
        return block_id, block.token_ids, block.next_token_id

    def eviction_order(self) -> list[int]:
        """Cached free blocks, next-to-evict first (for tests and debugging)."""
        return list(self._cached_free)

    # ------------------------------------------------------------------ mutations
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Hand out `num_blocks` private blocks (ref_count 1), evicting LRU cached blocks if needed.

        Returns:
            The block ids in allocation order, or None (and no state change) when not enough are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 0")
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._uncached_free:
                block_id = self._uncached_free.popleft()
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block; a free cached block leaves the LRU queue (a prefix hit)."""
        for block_id in block_ids:
            block = self._block(block_id)
            self._check_not_null(block_id, "incref")
            if block.ref_count == 0:
                if block_id not in self._cached_free:
                    raise BlockPoolError(f"incref of free uncached block {block_id}: its content is garbage")
                del self._cached_free[block_id]
            if block.block_hash is not None:
                block.num_hits += 1
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block, in the given order.

        Callers pass a request's blocks in reverse order, so its tail blocks reach the LRU queue first
        and are evicted before the (more widely shared) head of the prefix.
        """
        for block_id in block_ids:
            block = self._block(block_id)
            self._check_not_null(block_id, "free")
            if block.ref_count <= 0:
                raise BlockPoolError(f"double free of block {block_id} (ref_count would become {block.ref_count - 1})")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._uncached_free.append(block_id)
                else:
                    self._cached_free[block_id] = None

    def publish(self, block_id: int, block_hash: int, token_ids: Sequence[int], next_token_id: int | None = None,
                draft_exact: bool = True) -> bool:  # fmt: skip
        """Make a full, verified block findable by `lookup(block_hash)`.

        Args:
            next_token_id: the token after the block, which its last MTP draft KV entry was paired with
                (None: unknown, so no lookup may reuse that entry).
            draft_exact: its MTP draft entries are final too. False: only its main KV is (a request that stopped
                keeping its MTP plane wrote it); such a block serves lookups that will not draft, and a draft-exact
                block of the same content later takes the hash over (the old one stays frozen, evicted as usual).

        Returns:
            True when the block is now the hash's owner; False when another block already publishes the
            same content (this block then stays private and is recycled normally when freed).
        """
        block = self._block(block_id)
        self._check_not_null(block_id, "publish")
        if block.ref_count <= 0:
            raise BlockPoolError(f"publish of free block {block_id}")
        if len(token_ids) != self.block_size:
            raise BlockPoolError(f"publish of block {block_id} with {len(token_ids)} tokens; only full blocks "
                                 f"({self.block_size} tokens) are published")
        tokens = tuple(token_ids)
        if block.block_hash is not None:
            if (block.block_hash != block_hash or block.token_ids != tokens or block.next_token_id != next_token_id
                    or block.draft_exact != draft_exact):  # fmt: skip
                raise BlockPoolError(f"block {block_id} already published with hash {block.block_hash} (next token "
                                     f"{block.next_token_id}), refusing to republish it with hash {block_hash} "
                                     f"(next token {next_token_id})")
            return True
        owner = self._hash_to_block.get(block_hash)
        if owner is not None and (self.blocks[owner].draft_exact or not draft_exact):
            return False
        block.block_hash = block_hash
        block.token_ids = tokens
        block.next_token_id = next_token_id
        block.draft_exact = draft_exact
        self._hash_to_block[block_hash] = block_id
        return True

    # ------------------------------------------------------------------ helpers
    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.block_hash is not None
        if self._hash_to_block.get(block.block_hash) == block_id:
            del self._hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.next_token_id = None
        block.draft_exact = True
        block.num_hits = 0

    def _block(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self.blocks[block_id]

    @staticmethod
    def _check_not_null(block_id: int, what: str) -> None:
        if block_id == NULL_BLOCK_ID:
            raise BlockPoolError(f"{what} of the reserved null block {NULL_BLOCK_ID}")
