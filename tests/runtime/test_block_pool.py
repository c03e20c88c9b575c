"""BlockPool: exact block ids, reference counts, LRU eviction order and invariant checks (CPU only)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.core.block_pool import NULL_BLOCK_ID, BlockPool, BlockPoolError

B = 4


def make_pool(num_blocks: int = 8) -> BlockPool:
    return BlockPool(num_blocks=num_blocks, block_size=B)


def toks(start: int) -> list[int]:
    return list(range(start, start + B))


def test_null_block_is_never_handed_out():
    pool = make_pool(4)
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) is None
    assert NULL_BLOCK_ID not in pool.eviction_order()
    with pytest.raises(BlockPoolError, match="null block"):
        pool.free([NULL_BLOCK_ID])
    with pytest.raises(BlockPoolError, match="null block"):
        pool.incref([NULL_BLOCK_ID])


def test_allocate_is_fifo_and_all_or_nothing():
    pool = make_pool(6)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(4) is None  # only 3 left: nothing changes
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [3, 4, 5]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 1]
    pool.free([2, 1])
    assert pool.allocate(2) == [2, 1]  # freed uncached blocks come back in free order
    assert pool.allocate(0) == []


def test_cached_blocks_evicted_lru_after_uncached_ones():
    pool = make_pool(6)
    blocks = pool.allocate(4)
    assert blocks == [1, 2, 3, 4]
    for i, b in enumerate(blocks):
        assert pool.publish(b, block_hash=100 + i, token_ids=toks(10 * i))
    pool.free(reversed(blocks))  # reverse order: the tail (4) becomes least recently freed
    assert pool.eviction_order() == [4, 3, 2, 1]
    assert pool.num_free_blocks == 5 and pool.num_cached_free_blocks == 4
    assert pool.allocate(1) == [5]  # the uncached block goes first
    assert pool.allocate(2) == [4, 3]  # then LRU eviction, tail first
    assert pool.lookup(103) is None and pool.lookup(102) is None
    assert pool.block_hash(4) is None and not pool.is_published(4)
    assert pool.lookup(101) == (2, tuple(toks(10)), None)


def test_hit_on_cached_free_block_leaves_queue_and_refreshes_lru():
    pool = make_pool(5)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.publish(b, 200 + i, toks(i))
    pool.free([3, 2, 1])
    assert pool.eviction_order() == [3, 2, 1]
    pool.incref([2])  # a prefix hit removes it from the middle of the queue
    assert pool.eviction_order() == [3, 1]
    assert pool.ref_count(2) == 1 and pool.is_shared(2)  # published and re-used: frozen for writes
    pool.free([2])
    assert pool.eviction_order() == [3, 1, 2]  # most recently freed goes to the tail


def test_is_shared():
    pool = make_pool(4)
    (b,) = pool.allocate(1)
    assert not pool.is_shared(b)
    pool.publish(b, 7, toks(0))
    assert not pool.is_shared(b)  # published but nobody else uses it yet
    pool.incref([b])
    assert pool.is_shared(b) and pool.ref_count(b) == 2


def test_double_free_and_negative_refcount_raise():
    pool = make_pool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([b])
    assert pool.ref_count(b) == 0
    with pytest.raises(BlockPoolError, match="uncached"):
        pool.incref([b])  # a free uncached block has no meaningful content


def test_publish_records_next_token_until_eviction():
    pool = make_pool(3)
    b1, b2 = pool.allocate(2)
    assert pool.publish(b1, 5, toks(0), next_token_id=9)
    assert pool.lookup(5) == (b1, tuple(toks(0)), 9)
    with pytest.raises(BlockPoolError, match="next token"):
        pool.publish(b1, 5, toks(0), next_token_id=8)
    pool.free([b1])
    assert pool.allocate(2) is None  # b2 is still held: only b1 is free
    assert pool.lookup(5) is not None
    assert pool.allocate(1) == [b1]  # evicted
    assert pool.lookup(5) is None and pool.blocks[b1].next_token_id is None


def test_publish_rules():
    pool = make_pool(4)
    b1, b2 = pool.allocate(2)
    assert pool.publish(b1, 5, toks(0))
    assert pool.publish(b1, 5, toks(0))  # idempotent
    with pytest.raises(BlockPoolError, match="already published"):
        pool.publish(b1, 6, toks(0))
    assert not pool.publish(b2, 5, toks(0))  # same content elsewhere: b2 stays private
    assert pool.lookup(5) == (b1, tuple(toks(0)), None) and not pool.is_published(b2)
    with pytest.raises(BlockPoolError, match="only full blocks"):
        pool.publish(b2, 9, [1, 2])
    pool.free([b2])
    with pytest.raises(BlockPoolError, match="free block"):
        pool.publish(b2, 9, toks(0))


def test_a_draft_exact_block_takes_a_main_only_hash_over():
    """A block published main-only (its request no longer kept its MTP plane) serves lookups until a block of the
    same content with final draft entries is published: that one owns the hash from then on, and evicting the old
    one later does not unpublish the new owner."""
    pool = make_pool(5)
    main_only, exact, other = pool.allocate(3)
    assert pool.publish(main_only, 5, toks(0), next_token_id=9, draft_exact=False)
    assert pool.lookup(5) == (main_only, tuple(toks(0)), 9) and not pool.is_draft_exact(main_only)
    assert not pool.publish(other, 5, toks(0), next_token_id=9, draft_exact=False)  # no better: stays private
    assert pool.publish(exact, 5, toks(0), next_token_id=9)
    assert pool.lookup(5) == (exact, tuple(toks(0)), 9) and pool.is_draft_exact(exact)
    assert pool.is_published(main_only)  # still frozen: its holders read it, nobody writes it
    pool.free([main_only, other])
    assert main_only in pool.allocate(3)  # every free block: main_only is evicted too
    assert pool.lookup(5) == (exact, tuple(toks(0)), 9)


def test_constructor_validation():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "publish", "hit"]), st.integers(0, 5)), max_size=60))
def test_random_sequences_never_leak(ops):
    pool = make_pool(10)
    held: list[list[int]] = []  # each entry: one holder's blocks
    next_hash = 0
    for op, n in ops:
        if op == "alloc":
            before = pool.num_free_blocks
            got = pool.allocate(n)
            if got is None:
                assert n > before and pool.num_free_blocks == before
            else:
                assert len(set(got)) == n and NULL_BLOCK_ID not in got
                assert all(pool.ref_count(b) == 1 for b in got)
                held.append(got)
        elif op == "free" and held:
            pool.free(reversed(held.pop(n % len(held))))
        elif op == "publish" and held:
            for b in held[n % len(held)]:
                if not pool.is_published(b):
                    pool.publish(b, next_hash, toks(next_hash))
                    next_hash += 1
        elif op == "hit":
            found = pool.lookup(n % max(next_hash, 1))
            if found is not None:
                pool.incref([found[0]])
                held.append([found[0]])
        counts = {}
        for blocks in held:
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
        assert all(pool.ref_count(b) == counts.get(b, 0) >= 0 for b in range(1, 10))
        assert pool.num_free_blocks == sum(1 for b in range(1, 10) if b not in counts)
    while held:
        pool.free(reversed(held.pop()))
    assert pool.num_free_blocks == 9 and pool.num_used_blocks == 0
