"""KVCacheManager: block tables, lookahead growth, prefix hits under the MTP rule, copy-on-write (CPU only)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime.core.kv_manager as kv_manager
from runtime.core.kv_manager import KVCacheManager

B = 4


def make_manager(num_blocks: int = 16, *, prefix_caching: bool = True, mtp_cow: bool = False) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, enable_prefix_caching=prefix_caching, mtp_cow=mtp_cow)


GEN = 999  # the token sampled after a served prompt


# Test-only views of a manager (the runtime never needs them: executors get whole block tables).
def slot_mapping(mgr: KVCacheManager, req_id: str, positions: list[int]) -> list[int]:
    """Flat KV slot (block_id * B + offset) of each position."""
    table = mgr.block_table(req_id)
    return [table[p // B] * B + p % B for p in positions]


def writable(mgr: KVCacheManager, req_id: str, position: int) -> bool:
    """True when `position` lies in a block `req_id` owns exclusively and that is not frozen by publication."""
    if not mgr.has_request(req_id):
        return False
    table = mgr.block_table(req_id)
    if not 0 <= position < len(table) * B:
        return False
    block_id = table[position // B]
    return not mgr.pool.is_shared(block_id) and not mgr.pool.is_published(block_id)


def num_active_blocks(mgr: KVCacheManager, req_ids) -> int:
    """Distinct blocks referenced by the block tables of req_ids."""
    return len({b for r in req_ids if mgr.has_request(r) for b in mgr.block_table(r)})


def serve_prompt(mgr: KVCacheManager, req_id: str, prompt: list[int], gen: int = GEN) -> list[int]:
    """Allocate a request without a hit, commit the whole prompt (+ sampled base), publish, free it."""
    assert mgr.allocate(req_id, len(prompt) + 1)
    mgr.publish_full_blocks(req_id, prompt + [gen], len(prompt))
    table = mgr.block_table(req_id)
    mgr.free(req_id)
    return table


PROMPT = list(range(100, 112))  # 3 full blocks


def test_allocate_grow_free_exact_ids():
    mgr = make_manager(8)
    assert mgr.allocate("a", 5)  # positions 0..4 -> 2 blocks
    assert mgr.block_table("a") == [1, 2]
    assert mgr.allocate("a", 8)  # still 2 blocks
    assert mgr.block_table("a") == [1, 2]
    assert mgr.allocate("a", 9 + 4)  # lookahead for drafts: positions up to 12 -> 4 blocks
    assert mgr.block_table("a") == [1, 2, 3, 4]
    assert mgr.allocate("b", 1) and mgr.block_table("b") == [5]
    assert mgr.num_used_blocks == 5 and num_active_blocks(mgr, "ab") == 5 and mgr.num_free_blocks == 2
    assert slot_mapping(mgr, "a", [0, 5, 12]) == [4, 9, 16]
    mgr.free("a")
    mgr.assert_no_leaks()
    assert mgr.allocate("c", 16) and mgr.block_table("c") == [6, 7, 4, 3]  # uncached, freed tail first
    mgr.free("b")
    mgr.free("c")
    mgr.assert_no_leaks()
    assert mgr.num_free_blocks == 7


def test_allocate_failure_changes_nothing():
    mgr = make_manager(4)  # 3 usable blocks
    assert mgr.allocate("a", 8)
    assert not mgr.allocate("b", 9)  # needs 3, only 1 free
    assert not mgr.has_request("b")
    assert not mgr.allocate("a", 13)  # growth needs 2, only 1 free
    assert mgr.block_table("a") == [1, 2] and mgr.num_free_blocks == 1
    mgr.assert_no_leaks()


def test_free_blocks_of_a_hit_are_not_counted_twice():
    mgr = make_manager(8)  # 7 usable blocks
    serve_prompt(mgr, "a", PROMPT)  # blocks 1..3 cached and free: 7 free in total
    hit = mgr.find_prefix(PROMPT)
    assert hit.block_ids == [1, 2] and hit.num_cached_tokens == 8
    assert not mgr.can_allocate("b", 7 * B + 1, hit)  # 8 blocks: 2 hit + 6 new, but only 5 are free besides the hit
    assert not mgr.allocate("b", 7 * B + 1, hit)
    mgr.assert_no_leaks()
    assert mgr.num_free_blocks == 7 and mgr.pool.eviction_order() == [3, 2, 1]
    assert mgr.allocate("b", 7 * B, hit)
    assert mgr.block_table("b") == [1, 2, 5, 6, 7, 4, 3]  # uncached first; block 3 (given up) evicted last
    mgr.assert_no_leaks()


def test_only_full_committed_blocks_are_published():
    mgr = make_manager()
    assert mgr.allocate("a", 11)
    assert mgr.publish_full_blocks("a", PROMPT[:10], 7) == 1  # 7 committed positions: block 0 only
    assert mgr.publish_full_blocks("a", PROMPT[:10], 7) == 0  # idempotent
    assert mgr.publish_full_blocks("a", PROMPT[:10], 10) == 1
    assert [mgr.pool.is_published(b) for b in mgr.block_table("a")] == [True, True, False]
    assert mgr.pool.lookup(mgr.pool.block_hash(1)) == (1, tuple(PROMPT[:4]), PROMPT[4])  # type: ignore[arg-type]
    assert mgr.allocate("b", 9)
    assert mgr.publish_full_blocks("b", PROMPT[:8], 8) == 1  # block 1's next token is unknown yet
    assert mgr.publish_full_blocks("b", PROMPT[:9], 8) == 1
    with pytest.raises(ValueError, match="num_committed"):
        mgr.publish_full_blocks("a", PROMPT[:10], 11)


@pytest.mark.parametrize(
    ("prompt", "num_cached_tokens", "num_shared_blocks"),
    [
        pytest.param(PROMPT, 8, 2, id="same prompt: 3 matched, last given up"),
        pytest.param(PROMPT + [7, 7], 8, 2, id="longer prompt: 3 matched, last given up"),
        pytest.param(PROMPT[:8] + [0, 0, 0, 0], 4, 1, id="diverges in block 2"),
        pytest.param(PROMPT[:8], 4, 1, id="prompt ends at block end: last block given up"),
        pytest.param(PROMPT[:9], 8, 2, id="next token known and equal: 2 blocks reused"),
        pytest.param(PROMPT[:6], 4, 1, id="1 block, next token equal"),
        pytest.param(PROMPT[:4], 0, 0, id="one full block = whole prompt, given up"),
        pytest.param(PROMPT + [GEN, 5], 12, 3, id="follow-up turn: continuation matches"),
        pytest.param(PROMPT[:3], 0, 0, id="no full block"),
        pytest.param([0] + PROMPT[1:], 0, 0, id="first token differs"),
    ],
)
def test_prefix_hit_gives_up_last_matched_block(prompt, num_cached_tokens, num_shared_blocks):
    mgr = make_manager()
    table_a = serve_prompt(mgr, "a", PROMPT)
    hit = mgr.find_prefix(prompt)
    assert hit.num_cached_tokens == num_cached_tokens < len(prompt)  # never the whole prompt
    assert hit.block_ids == table_a[:num_shared_blocks]
    assert mgr.allocate("b", len(prompt) + 1, hit)
    assert mgr.block_table("b")[:num_shared_blocks] == table_a[:num_shared_blocks]
    assert all(mgr.pool.ref_count(b) == 1 for b in hit.block_ids)
    assert mgr.stats.num_hit_tokens == num_cached_tokens
    # every position the request computes lands in a block it owns exclusively; reused ones are read-only
    assert all(writable(mgr, "b", p) for p in range(num_cached_tokens, len(prompt) + 1))
    assert not any(writable(mgr, "b", p) for p in range(num_cached_tokens))
    mgr.free("b")
    mgr.assert_no_leaks()


def test_disabled_cache_gets_no_hit():
    off = make_manager(prefix_caching=False)
    serve_prompt(off, "a", PROMPT)
    assert off.find_prefix(PROMPT).num_matched_blocks == 0
    assert not any(off.pool.is_published(b) for b in range(1, 16))


def test_hits_on_shared_prefix_of_different_lengths_share_blocks():
    mgr = make_manager()
    long_prompt = PROMPT + list(range(200, 208))  # 5 full blocks
    table_a = serve_prompt(mgr, "a", long_prompt)
    hits = {n: mgr.find_prefix(long_prompt[:n]) for n in (9, 13, 20)}
    assert {n: h.num_cached_tokens for n, h in hits.items()} == {9: 8, 13: 12, 20: 16}
    for n, hit in hits.items():
        assert mgr.allocate(f"r{n}", n + 1, hit)
    assert mgr.pool.ref_count(table_a[0]) == 3 and mgr.pool.ref_count(table_a[3]) == 1
    mgr.assert_no_leaks()
    for n in hits:
        mgr.free(f"r{n}")
    mgr.assert_no_leaks()


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_manager, "hash_block_tokens", lambda parent, tokens: 42)
    mgr = make_manager()
    serve_prompt(mgr, "a", PROMPT)
    assert mgr.find_prefix([1] * 12).num_matched_blocks == 0
    assert mgr.find_prefix(PROMPT).num_matched_blocks == 1  # every block collides: only block 0's tokens match


def test_stale_hit_raises():
    mgr = make_manager(4)  # 3 usable blocks
    serve_prompt(mgr, "a", PROMPT[:9])  # publishes blocks 1, 2; block 3 uncached
    hit = mgr.find_prefix(PROMPT[:9])
    assert hit.block_ids == [1, 2]
    assert mgr.allocate("x", 12)  # evicts the cached blocks
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate("b", 10, hit)


def test_cow_keeps_all_matched_blocks_and_copies_the_last():
    mgr = make_manager(8, mtp_cow=True)
    table_a = serve_prompt(mgr, "a", PROMPT)
    hit = mgr.find_prefix(PROMPT)
    assert hit.num_cached_tokens == 11 and hit.block_ids == table_a[:2] and hit.cow_block_id == table_a[2]
    assert mgr.allocate("b", 13, hit)
    table_b = mgr.block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert mgr.pending_copies() == [(table_a[2], table_b[2])]
    assert mgr.pool.ref_count(table_a[2]) == 1  # pinned until the executor copied it
    assert writable(mgr, "b", 11) and not writable(mgr, "b", 10 - B)
    assert mgr.stats.num_given_up_tokens == 1 and mgr.stats.num_cow_copies == 1
    mgr.assert_no_leaks()
    mgr.complete_copies()
    assert mgr.pending_copies() == [] and mgr.pool.ref_count(table_a[2]) == 0
    mgr.assert_no_leaks()
    mgr.free("b")
    mgr.assert_no_leaks()


def test_cow_source_stays_pinned_until_copied():
    mgr = make_manager(6, mtp_cow=True)  # 5 usable blocks
    table_a = serve_prompt(mgr, "a", PROMPT[:8] + [1])  # blocks 1, 2 published, block 3 private
    assert table_a == [1, 2, 3]
    hit = mgr.find_prefix(PROMPT[:8] + [2])  # block 1 (id 2) was followed by 1, not 2: copy it
    assert hit.block_ids == [1] and hit.cow_block_id == 2 and hit.num_cached_tokens == 7
    assert mgr.allocate("b", 8, hit)
    assert mgr.pending_copies() == [(2, 4)]
    assert not mgr.allocate("c", 12)  # blocks 1 and 2 are held, only 5 and 3 are free
    assert mgr.allocate("c", 8) and mgr.block_table("c") == [5, 3]
    mgr.free("b")  # freeing before the copy ran also unpins the source
    assert mgr.pending_copies() == [] and mgr.pool.is_free(2)
    mgr.assert_no_leaks()


@pytest.mark.parametrize(("mtp_cow", "num_cached_tokens"), [(False, 0), (True, 3)])
def test_duplicate_block_with_other_continuation_is_not_reused(mtp_cow, num_cached_tokens):
    """Regression: block 0 of the hit chain was published by a request that continued differently."""
    mgr = make_manager(mtp_cow=mtp_cow)
    serve_prompt(mgr, "a", [1, 2, 3, 1], gen=0)  # block 0's last draft entry pairs with 0
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    hit = mgr.find_prefix(prompt)
    assert mgr.allocate("b", 9, hit)
    mgr.publish_full_blocks("b", prompt + [GEN], 8)  # b's block 0 duplicates a's (stays private), block 1 is new
    hit = mgr.find_prefix(prompt)
    assert hit.num_matched_blocks == 2 and hit.num_cached_tokens == num_cached_tokens


class FakeKV:
    """Simulated main and MTP draft planes: slot -> token / (token, next token) written there."""

    def __init__(self) -> None:
        self.main: dict[int, int] = {}
        self.draft: dict[int, tuple[int, int]] = {}

    def write(self, mgr: KVCacheManager, req: str, p: int, tokens: list[int], plane: str) -> None:
        assert writable(mgr, req, p), f"write of {plane} KV at position {p} of {req} into a shared/foreign block"
        (slot,) = slot_mapping(mgr, req, [p])
        if plane == "main":
            self.main[slot] = tokens[p]
        else:
            self.draft[slot] = (tokens[p], tokens[p + 1])

    def copy(self, src: int, dst: int) -> None:
        for off in range(B):
            for plane in (self.main, self.draft):
                if src * B + off in plane:
                    plane[dst * B + off] = plane[src * B + off]  # type: ignore[index]


BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 2, 3, 1, 2, 0, 0, 1, 1, 2, 2, 3, 3]]


@pytest.mark.parametrize("mtp_cow", [False, True], ids=["give-up", "cow"])
@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "step", "step", "free"]), st.integers(0, 1000)),
                    max_size=40))
def test_random_requests_reuse_only_correct_kv_and_never_leak(mtp_cow, ops):
    """Every reused position holds main KV for its token and draft KV paired with the *same* next token."""
    mgr, kv, rnd = make_manager(16, mtp_cow=mtp_cow), FakeKV(), random.Random(0)
    live: dict[str, list[int]] = {}  # req -> tokens; committed = len(tokens) - 1 (the last is the base)
    for i, (op, n) in enumerate(ops):
        if op == "start":
            prompt = BASES[n % 2][: 2 + n % 15] + [n % 3] * (n % 4)
            hit = mgr.find_prefix(prompt)
            free_before = mgr.num_free_blocks
            if not mgr.allocate(f"r{i}", len(prompt) + 2, hit):  # +2: lookahead
                assert mgr.num_free_blocks == free_before and not mgr.has_request(f"r{i}")
                continue
            req, tokens = f"r{i}", prompt + [rnd.randrange(4)]
            for src, dst in mgr.pending_copies():
                kv.copy(src, dst)
            mgr.complete_copies()
            for p in range(hit.num_cached_tokens):  # the reused KV must be what this prompt would compute
                (slot,) = slot_mapping(mgr, req, [p])
                assert kv.main[slot] == prompt[p] and kv.draft[slot] == (prompt[p], prompt[p + 1])
            for p in range(hit.num_cached_tokens, len(prompt)):
                kv.write(mgr, req, p, tokens, "main")
                kv.write(mgr, req, p, tokens, "draft")  # the last one is depth 0, paired with the new base
            live[req] = tokens
            mgr.publish_full_blocks(req, tokens, len(prompt))
        elif op == "step" and live:
            req = sorted(live)[n % len(live)]
            tokens = live[req]
            if not mgr.allocate(req, len(tokens) + 2):
                mgr.free(req)  # preempted
                del live[req]
            else:
                tokens.append(rnd.randrange(4))
                kv.write(mgr, req, len(tokens) - 2, tokens, "main")  # forward the old base
                kv.write(mgr, req, len(tokens) - 2, tokens, "draft")  # paired with the new base
                mgr.publish_full_blocks(req, tokens, len(tokens) - 1)
        elif op == "free" and live:
            req = sorted(live)[n % len(live)]
            mgr.free(req)
            del live[req]
        mgr.assert_no_leaks()
    for req in list(live):
        mgr.free(req)
    mgr.assert_no_leaks()
    assert mgr.num_free_blocks == 15 and mgr.num_used_blocks == 0
