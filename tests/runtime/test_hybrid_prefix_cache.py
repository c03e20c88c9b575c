"""Prefix caching for hybrid (Gated DeltaNet) models through state snapshots (runtime/core/state_snapshots.py): a prefix
hit resumes the recurrence from the snapshot of its last reused block, so its output is token-identical to the same
requests without prefix caching, with MTP off and on, chunked prefill and preemption, also from a snapshot stored
every `state_snapshot_interval` tokens inside a forward (holding the state after its block's last row); hits are
reported; no KV block, state group or snapshot slot leaks; the snapshot budget evicts least recently used snapshots and
snapshots whose block was evicted, and a long prompt keeps only its share of interval snapshots. A restore planted from
the block before's snapshot changes the outputs (test_a_restore_from_the_block_befores_snapshot_is_caught)."""

from __future__ import annotations

import pytest
import torch

from models.testing import make_hybrid_checkpoint
from runtime.core.block_pool import BlockPool
from runtime.core.sampling import SamplingParams
from runtime.core.state_pool import StateSlots
from runtime.core.state_snapshots import StateSnapshots
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts

VOCAB = 6  # a random MTP module then accepts some drafts and rejects others: rollbacks and hits together
SHARED = random_prompts((22,), vocab=VOCAB, seed=7)[0]  # a "system prompt" of 5.5 blocks of 4
TAILS = random_prompts((5, 9, 3, 7), vocab=VOCAB, seed=8)
WAVE1 = [SHARED + TAILS[0], SHARED + TAILS[1]]  # admitted together: nothing is cached yet
WAVE2 = [SHARED + TAILS[2], SHARED + TAILS[0], list(WAVE1[1]), SHARED + TAILS[3]]  # the same prefix, later
PARAMS = SamplingParams(max_tokens=10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    make_hybrid_checkpoint(path, "qwen3_next", seed=2, vocab_size=VOCAB)
    return path


def engine_for(path, k: int, **rc):
    opts = dict(num_draft_tokens=k, block_size=4, num_blocks=120, max_batch=4, max_num_tokens=64, max_seq_len=64)
    return create_engine(checkpoint=path, executor="torch", **{**opts, **rc})


def run_waves(engine, waves=(WAVE1, WAVE2)):
    """Each wave runs to completion before the next is added; returns output ids and cached tokens per request."""
    ids, cached = [], []
    for wave in waves:
        for out in engine.generate(wave, PARAMS):
            ids.append(out.output_ids)
            cached.append(out.num_cached_tokens)
    return ids, cached


def assert_nothing_leaked(engine):
    slots, snaps = engine.state_slots, engine.state_slots.snapshots
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1, "KV blocks leaked"
    assert slots.num_free_groups == engine.cfg.max_batch, "state slot groups leaked"
    if snaps is not None:
        snaps.assert_no_leaks()
        assert snaps.num_free == snaps.num_slots, "snapshot slots leaked (pinned or pending after every request)"


@pytest.fixture(scope="module")
def reference(checkpoint):
    """K=0 without prefix caching: what every configuration below must emit (invariant 4)."""
    engine = engine_for(checkpoint, 0, enable_prefix_caching=False)
    assert engine.state_slots.snapshots is None
    return run_waves(engine)[0]


@pytest.mark.parametrize(("k", "chunk"), [(0, 256), (2, 256), (2, 8), (1, 5)])
def test_hits_are_token_identical(checkpoint, reference, k, chunk):
    engine = engine_for(checkpoint, k, max_prefill_chunk=chunk)
    ids, cached = run_waves(engine)
    assert ids == reference
    # a forward snapshots the last block boundary among its rows: a repeated prompt (27 and 31 tokens) reuses every
    # full block the MTP rule lets it (6 and 7 blocks); a new tail after the 22 shared tokens reuses the shared full
    # blocks up to the last snapshot inside them (chunked prefill leaves some; one whole-prompt forward none)
    assert cached[0] == 0 and cached[3:5] == [24, 28], cached  # wave 1's second: a hit when prefilled after chunks
    assert all(c <= 20 and c % 4 == 0 for c in (cached[2], cached[5])), cached
    assert engine.metrics.prefix_hit_tokens == sum(cached) == engine.kv.stats.num_hit_tokens
    assert_nothing_leaked(engine)


def test_a_cut_back_hit_snapshots_its_branch_point_for_the_next_request(checkpoint, reference):
    """One whole-prompt forward snapshots only its last block boundary (inside the first tail), so the first sharer's
    hit is cut back (to nothing here) and it stores a snapshot at the end of the shared blocks; the next request with
    that prefix then reuses all 20 shared tokens (>= 90% of the 22-token prefix)."""
    engine = engine_for(checkpoint, 2)
    waves = [[SHARED + TAILS[0]], [SHARED + TAILS[1]], [SHARED + TAILS[2]]]
    ids, cached = run_waves(engine, waves)
    assert ids == [reference[0], reference[1], reference[2]]
    assert cached[0] == 0 and cached[1] < 20 and cached[2] == 20, cached
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("chunk", [256, 12])
def test_a_hit_resumes_from_an_interval_snapshot_inside_a_forward(checkpoint, reference, chunk):
    """A snapshot every 8 tokens (2 blocks): the first sharer of the 22-token prefix resumes after token 16, from the
    interval snapshot inside the forward that prefilled the first request (its whole prompt, or its chunk of rows
    12..23), where each forward's last block boundary alone leaves it 0 or 12 tokens."""
    engine = engine_for(checkpoint, 2, max_prefill_chunk=chunk, state_snapshot_interval=8)
    ids, cached = run_waves(engine, [[SHARED + TAILS[0]], [SHARED + TAILS[1]]])
    assert ids == reference[:2] and cached == [0, 16], cached
    assert_nothing_leaked(engine)


def test_a_restore_from_the_block_befores_snapshot_is_caught(checkpoint, reference, monkeypatch):
    """The planted bug: a hit resumes from the snapshot of the block before its last reused one (the state one block
    short). The hit itself still happens and the accounting stays whole, so only the outputs can tell: they must
    differ from the reference, or the token-identity tests above could not catch a restore off by a block."""
    planted = []
    right_group = StateSlots._group

    def group_from_the_block_before(self, s):
        resumes = s.start > 0 and s.req.req_id not in self._groups  # a new group for a request with a prefix hit
        g = right_group(self, s)
        if resumes:
            table = self.kv.block_table(s.req.req_id)
            before = self.snapshots.slot_of(table[s.start // self.kv.block_size - 2])
            assert before is not None, "every block has a snapshot at interval 4: the block before must too"
            self.snapshots.unpin(g.current)
            self.snapshots.pin(before)
            g.current = before
            planted.append(s.req.req_id)
        return g

    monkeypatch.setattr(StateSlots, "_group", group_from_the_block_before)
    engine = engine_for(checkpoint, 2, state_snapshot_interval=4)
    ids, cached = run_waves(engine, [[SHARED + TAILS[0]], [SHARED + TAILS[1]]])
    assert planted and cached[1] >= 8, (planted, cached)  # the second request resumed from a (planted) snapshot
    assert ids[0] == reference[0], "the first request has no hit: the plant must not touch it"
    assert ids[1] != reference[1], "a restore one block short went unnoticed"
    assert_nothing_leaked(engine)


def test_an_interval_snapshot_is_the_state_after_its_block(checkpoint):
    """Block 3's snapshot stored by an interval row inside a whole-prompt forward == the one a forward ending at that
    block stores as its last boundary: the row completing the block stores it, not a neighbour (a state one token off
    can still give the same tokens on this model)."""
    states = []
    for interval, prompt in ((8, SHARED + TAILS[0]), (0, SHARED[:17])):
        engine = engine_for(checkpoint, 2, state_snapshot_interval=interval)
        list(engine.generate([prompt], PARAMS))
        slot = engine.state_slots.snapshots.slot_of(engine.kv.find_prefix(SHARED[:17]).block_ids[3])
        states.append((engine.executor.state.conv[:, slot], engine.executor.state.ssm[:, slot]))
    for got, want in zip(*states, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # the op's chunking differs: rounding only


class WriteSlotsSeen:
    """The executor, recording the slots each main forward writes (`state_write_slots` >= 0)."""

    def __init__(self, inner):
        self.inner, self.writes = inner, []

    def run_main(self, inp):
        self.writes.append(inp.state_write_slots[inp.state_write_slots >= 0].tolist())
        return self.inner.run_main(inp)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_long_prompt_keeps_its_share_and_leaves_other_prefixes_their_snapshots(checkpoint):
    """Budget 8 at max_batch 4: a 50-token prompt asking for an interval snapshot at every block keeps only its share
    (2) of them, its latest, so a short prompt's snapshot from before survives and its repeat still hits; no forward
    writes a slot from two rows (a claim past the share never replaces a row of the same forward)."""
    seen: list[WriteSlotsSeen] = []
    engine = engine_for(checkpoint, 2, num_state_snapshots=8, state_snapshot_interval=4,
                        wrap_executor=lambda ex: seen.append(WriteSlotsSeen(ex)) or seen[0])  # fmt: skip
    short, long_ = random_prompts((10, 50), vocab=VOCAB, seed=9)
    ids, cached = run_waves(engine, [[short], [long_], [short], [long_[:45]]])
    assert all(len(set(w)) == len(w) for w in seen[0].writes) and len(seen[0].writes) > 4
    assert cached == [0, 0, 8, 44], cached  # long_[:45] resumes from the latest interval snapshot it kept (block 10)
    assert engine.state_slots.snapshots.num_cached <= 2 + 2 + 1  # short's two, long_'s share and last boundary
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("interval", [None, 4])
def test_preemption_and_a_tiny_snapshot_budget_stay_lossless(checkpoint, reference, interval):
    """Few KV blocks: requests are preempted and recomputed (from their own published prefix when it survived); two
    snapshot slots: snapshots are evicted while others are read, and (interval 4) every block boundary of a prompt
    asks for one. Output unchanged, nothing leaks."""
    engine = engine_for(checkpoint, 2, num_blocks=28, max_prefill_chunk=8, num_state_snapshots=2,
                        state_snapshot_interval=interval)  # fmt: skip
    assert engine.state_slots.snapshots.num_slots == 2
    ids, cached = run_waves(engine)
    assert ids == reference and engine.metrics.num_preemptions > 0
    assert_nothing_leaked(engine)


def test_no_snapshot_slot_turns_prefix_caching_off(checkpoint, reference):
    engine = engine_for(checkpoint, 1, num_state_snapshots=0)
    assert not engine.cfg.enable_prefix_caching and engine.state_slots.snapshots is None
    ids, cached = run_waves(engine, [WAVE1[:1], WAVE1[:1]])
    assert ids == [reference[0]] * 2 and cached == [0, 0]


# ---------------------------------------------------------------------- the snapshot store alone (no model)
def published_pool(num_blocks: int = 6) -> BlockPool:
    pool = BlockPool(num_blocks, 2)
    for b in pool.allocate(num_blocks - 1) or []:
        pool.publish(b, 1000 + b, [b, b])
    return pool


def test_snapshots_follow_their_block_and_evict_least_recently_used_first():
    pool = published_pool()
    snaps = StateSnapshots(first_slot=10, num_slots=2, pool=pool)
    assert snaps.claim("a", 0) == 10 and snaps.claim("a", 1) == 11 and snaps.claim("a", 2) is None  # budget 2
    snaps.publish("a", [1001, 1002])  # blocks 0 and 1 of "a" are pool blocks 1 and 2
    assert (snaps.slot_of(1), snaps.slot_of(2)) == (10, 11) and snaps.num_free == 2
    assert snaps.usable_blocks([1, 2, 3]) == 2 and snaps.usable_blocks([3, 4]) == 0
    snaps.unpin(snaps.read(1))  # block 1's snapshot used: block 2's is now the least recently used
    assert snaps.claim("b", 5) == 11 and snaps.slot_of(2) is None
    snaps.free("b")
    pool.free(range(1, 6))
    pool.allocate(5)  # every cached block is evicted and reused, block 1 included: its snapshot dies with it
    assert snaps.slot_of(1) is None and snaps.usable_blocks([1]) == 0
    assert snaps.claim("c", 0) == 11 and snaps.claim("c", 1) == 10  # the stale snapshot's slot is reclaimed
    snaps.free("c")
    snaps.assert_no_leaks()


def test_a_pinned_snapshot_is_never_evicted():
    pool = published_pool()
    snaps = StateSnapshots(first_slot=0, num_slots=1, pool=pool)
    snaps.claim("a", 0)
    snaps.publish("a", [1001])
    slot = snaps.read(1)  # a request resumes from it: pinned
    assert snaps.claim("b", 0) is None and snaps.num_free == 0
    snaps.unpin(slot)
    assert snaps.claim("b", 0) == slot
    snaps.free("b")
    with pytest.raises(RuntimeError, match="no state snapshot for block 1"):
        snaps.read(1)
    snaps.assert_no_leaks()


def test_interval_snapshots_replace_their_own_oldest_past_the_request_share():
    """A long prompt's interval snapshots (share 2 of 4 slots) replace each other, oldest first, whether pending or
    cached; another prefix's cached snapshot and the fourth slot are left alone."""
    pool = published_pool(8)
    snaps = StateSnapshots(first_slot=0, num_slots=4, pool=pool)
    assert snaps.claim("x", 0) == 0
    snaps.publish("x", [1001])  # another prefix: block 1's snapshot, cached
    assert [snaps.claim_interval("a", i, share=2) for i in (1, 2)] == [1, 2]
    snaps.publish("a", [1001, 1002, 1003])  # a's blocks 1 and 2 are pool blocks 2 and 3
    assert snaps.claim_interval("a", 3, share=2) == 1 and snaps.slot_of(2) is None  # the cached oldest replaced
    assert snaps.claim_interval("a", 4, share=2) == 2 and snaps.slot_of(3) is None
    assert snaps.claim_interval("a", 5, share=2) == 1  # a pending one replaced: block 4's never gets cached
    snaps.publish("a", [1001, 1002, 1003, 1004, 1005, 1006])
    assert [snaps.slot_of(b) for b in (1, 4, 5, 6)] == [0, None, 2, 1] and snaps.num_free == 4
    snaps.free("a")
    snaps.assert_no_leaks()
