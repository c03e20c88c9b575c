"""Per-request verify lengths (--num-draft-tokens per-request): ragged draft loops and verifies stay lossless
(greedy ids equal K=0's with chunked prefill, prefix hits and preemption), and the policy is exact,
deterministic, capped by each request's remaining tokens and breaks ties by position."""

from __future__ import annotations

from fractions import Fraction

import pytest

from runtime.core.cost_model import CostCurve, CostModel, agree, main_rows, monotone
from runtime.core.sampling import SamplingParams
from runtime.core.step_record import StepRecord
from runtime.core.verify_lengths import (
    EXPLORE_EVERY,
    EXPLORER_EVERY,
    GIVE_UP_AFTER,
    AcceptanceCounts,
    AcceptancePolicy,
    Candidate,
    FixedPattern,
)
from runtime.factory import create_engine
from tests.runtime.engine_utils import make_engine, random_prompts
from tests.runtime.test_commit_coverage import run_and_check

PROMPTS = random_prompts((5, 13, 9, 22, 3), seed=3)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PARAMS = SamplingParams(max_tokens=20)


def run(engine, prompts=PROMPTS):
    outs = engine.generate(prompts, PARAMS)
    engine.kv.assert_no_leaks()
    return [o.output_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    return run(make_engine(0, enable_prefix_caching=False))


@pytest.mark.parametrize(("pattern", "rc"), [
    ((3, 0, 1, 2), dict(max_prefill_chunk=6)),  # chunked prefill, mid-block splits
    ((2, 3, 0), dict(num_blocks=24, max_seq_len=64)),  # a small pool: preemption mid-decode
])  # fmt: skip
def test_forced_ragged_lengths_are_lossless(reference, pattern, rc):
    policy = FixedPattern(pattern)
    engine = make_engine(3, verify_lengths=policy, **rc)
    assert run(engine) == reference
    assert engine.metrics.prefix_hit_tokens > 0 or not engine.cfg.enable_prefix_caching
    assert any(len(set(ks)) > 1 for ks in policy.chosen)  # ragged steps really ran
    if rc.get("num_blocks") == 24:
        assert engine.metrics.num_preemptions > 0


@pytest.mark.parametrize("pattern", [(3, 0, 1, 2), (0, 0, 2)])  # (0, 0, 2): steps where nobody drafts (deferred rows)
def test_ragged_lengths_keep_every_mtp_entry_exact(pattern):
    """Losslessness alone cannot see a hole in the MTP plane (drafts only propose): every committed position's
    entry must still come from a main hidden, a request with k_i = 0 folding its tail into the commit."""
    violations, writes = run_and_check(3, 5, [7, 12, 3, 9], seed=1, budget=40, verify_lengths=FixedPattern(pattern))
    assert not violations, violations[:5]
    assert any(w.kind == f"draft{max(pattern) - 1}" for w in writes)


def test_acceptance_policy_is_lossless_and_adapts(reference):
    engine = make_engine(3, num_draft_tokens=3, per_request_draft_tokens=True)
    assert run(engine) == reference
    assert run(engine) == reference  # admitted once the policy settled (most without an MTP plane, explorers with)
    proposed = engine.metrics.proposed_per_position
    assert proposed[0] > 0  # it drafted (an explorer did), and not a fixed K for everyone at every step
    assert proposed[0] > proposed[2] or engine.metrics.draft_length_counts[3] < sum(engine.metrics.draft_length_counts)


def counts(*verifies: tuple[int, int]) -> AcceptanceCounts:
    c = AcceptanceCounts()
    for n, a in verifies:
        c.observe(n, a)
    return c


def test_counts_are_integer_and_decay():
    c = counts(*[(3, 3)] * 40)
    assert all(isinstance(x, int) for x in c.trials + c.hits)
    assert c.rate(0) > Fraction(9, 10)
    for _ in range(40):  # acceptance collapses: the old successes decay away
        c.observe(3, 0)
    assert c.rate(0) < Fraction(1, 5)
    assert c.trials[1] < c.trials[0]  # depth 1 was reached only while depth 0 was accepted


def costs(main: dict[int, int], draft: int = 100, commit: int = 1) -> CostModel:
    """A cost model by hand: main microseconds at the given rows, a flat draft call and commit."""
    rows = tuple(sorted(main))
    flat = (1, 64)
    return CostModel(CostCurve(rows, tuple(main[r] for r in rows)), CostCurve(flat, (draft, draft)),
                     CostCurve(flat, (commit, commit)))  # fmt: skip


CHEAP = costs({1: 1000, 64: 4150})  # a verify row 1/20 of a verify, a draft call 1/10: a row pays from ~0.2 tokens


def test_policy_follows_acceptance_and_remaining_tokens():
    good, bad = counts(*[(3, 3)] * 20), counts(*[(3, 0)] * 20)
    policy = AcceptancePolicy(CHEAP)
    assert policy.choose([Candidate(good, 100), Candidate(bad, 100)], 3) == [3, 0]
    # the tail of a closed batch: at most remaining - 1 drafts (the verify emits k + 1 tokens at most)
    assert policy.choose([Candidate(good, 2), Candidate(good, 1), Candidate(good, 0)], 3) == [1, 0, 0]


def test_policy_prices_rows_with_the_cost_model():
    good = [Candidate(counts(*[(3, 3)] * 20), 100) for _ in range(4)]
    assert AcceptancePolicy(CHEAP).choose(good, 3) == [3, 3, 3, 3]
    # each verify row past 4 costs a whole verify: no draft is worth it
    assert AcceptancePolicy(costs({1: 1000, 4: 1000, 5: 2000, 64: 61000})).choose(good, 3) == [0, 0, 0, 0]
    # a draft call 0.85 of a verify: the first depth pays (3.7 tokens more), a second (3.4 more) does not
    assert AcceptancePolicy(costs({1: 1000, 64: 1000}, draft=850)).choose(good, 3) == [1, 1, 1, 1]


def test_policy_ties_go_to_the_earlier_request():
    same = [Candidate(counts(*[(3, 2)] * 10), 50) for _ in range(3)]
    cost = costs({1: 1000, 5: 1000, 6: 100000, 64: 100000})  # 3 base rows + 2 draft rows fit, a 6th row never pays
    ks = AcceptancePolicy(cost).choose(same, 3)
    assert ks == [1, 1, 0]  # equal gains: depth 0 by position (request 2 loses), before any depth 1
    assert AcceptancePolicy(cost).choose(same, 3) == ks  # deterministic


def test_new_requests_start_from_the_engine_wide_acceptance():
    cost = costs({1: 1000, 64: 1000}, draft=600)  # alone, a depth pays only when its gain is well over 1/2
    fresh = Candidate(AcceptanceCounts(), 100)
    assert AcceptancePolicy(cost).choose([fresh], 3) == [0]  # alone, p = 1/2: not worth a draft call
    policy = AcceptancePolicy(cost)
    policy.choose([Candidate(AcceptanceCounts(), 100, (3, 3)) for _ in range(40)], 3)  # the engine sees 3/3s
    assert policy.choose([fresh], 3) == [3]


def test_a_settled_policy_is_unsettled_once_drafting_pays_again():
    """Settled, most admissions start frozen; an explorer whose drafts are accepted makes drafting pay again,
    and later admissions keep their planes (the integer admission count picks the explorers)."""
    policy, fresh = AcceptancePolicy(costs({1: 1000, 64: 1000}, draft=600)), AcceptanceCounts()
    for _ in range(GIVE_UP_AFTER):
        assert policy.choose([Candidate(fresh, 100)], 3) == [0]  # alone at p = 1/2: a draft call does not pay
    assert policy.settled_on_nothing
    kept = [policy.keeps_mtp_plane() for _ in range(2 * EXPLORER_EVERY)]
    assert kept == [i % EXPLORER_EVERY == 0 for i in range(1, 2 * EXPLORER_EVERY + 1)]
    policy.choose([Candidate(AcceptanceCounts(), 100, (3, 3)) for _ in range(40)], 3)  # the explorers' 3/3s
    assert policy.choose([Candidate(AcceptanceCounts(), 100)], 3) == [3] and not policy.settled_on_nothing
    assert policy.keeps_mtp_plane()


def test_policy_gives_up_then_explores():
    policy, fresh = AcceptancePolicy(costs({1: 1000, 64: 64000}, draft=5000)), AcceptanceCounts()  # never pays
    seen = []
    for _ in range(EXPLORE_EVERY):
        seen.append((policy.choose([Candidate(fresh, 100)], 3), policy.gives_up_drafting))
    assert seen[GIVE_UP_AFTER - 2] == ([0], False) and seen[GIVE_UP_AFTER - 1] == ([0], True)
    assert seen[-1] == ([1], False)  # a depth-0 draft now and then: a fallen acceptance is measured again
    assert policy.settled_on_nothing  # ... which is no choice to draft: the policy stays settled


class RecordingPolicy(AcceptancePolicy):
    """Records each admission's keeps_mtp_plane verdict (the test reads `kept`)."""

    kept: list[bool] = []

    def keeps_mtp_plane(self) -> bool:
        self.kept.append(super().keeps_mtp_plane())
        return self.kept[-1]


def test_settled_policy_admits_requests_without_their_mtp_plane(reference):
    """Settled on drafting nothing, an admitted request neither commits its prompt nor drafts, except every
    EXPLORER_EVERY-th admission (it keeps its plane and is priced); greedy ids still equal K=0's."""
    policy = RecordingPolicy(costs({1: 1000, 64: 64000}, draft=5000))  # drafting never pays
    policy.kept = []
    engine = make_engine(3, verify_lengths=policy, enable_prefix_caching=False)
    first_seen: dict[str, bool] = {}  # request id -> whether it had its MTP plane after its first step
    commit_rows: list[int] = []

    def watch(record: StepRecord) -> None:
        commit_rows.append(sum(record.commit_rows))
        for r in engine.scheduler.running:
            first_seen.setdefault(r.req_id, r.spec.may_draft)

    engine.step_listeners.append(watch)
    assert run(engine) == reference and policy.settled_on_nothing
    batch = engine.cfg.max_batch
    assert policy.kept[:batch] == [True] * batch and not all(policy.kept)  # kept until settled, mid-round
    first_round, commit_rows[:], first_seen = sum(commit_rows), [], {}
    assert run(engine) == reference
    explorers = [i % EXPLORER_EVERY == 0 for i in range(len(PROMPTS) + 1, 2 * len(PROMPTS) + 1)]
    assert policy.kept[len(PROMPTS) :] == explorers and any(explorers)
    assert list(first_seen.values()) == explorers  # the others never held a plane, not even for their prompt
    explorer = PROMPTS[explorers.index(True)]
    assert 0 < sum(commit_rows) <= len(explorer) + GIVE_UP_AFTER < first_round  # the explorer's rows alone


def test_policy_learns_host_costs_from_step_records():
    policy = AcceptancePolicy(costs({1: 1000, 64: 1000}, draft=100))
    policy.choose([Candidate(AcceptanceCounts(), 100)], 3)
    mtp = StepRecord(num_scheduled=1, main_rows=2, commit_rows=[2], draft_rows=[1], clock_seconds=0.0021,
                     clock_draft_seconds=0.0003)  # fmt: skip
    plain = StepRecord(num_scheduled=1, main_rows=1, clock_seconds=0.0013)
    for _ in range(40):
        policy.observe(mtp)
        policy.observe(plain)
    # 1800 us outside the draft phase = 1000 main + 1 commit + 799 host; the draft phase 300 = 100 graph + 200 host
    assert abs(policy.step_extra_us - 799) < 10 and abs(policy.depth_extra_us - 200) < 10
    assert abs(policy.plain_extra_us - 300) < 10


def test_a_slow_outlier_does_not_price_drafting_out():
    """One descheduled step (a 60 ms draft phase) is clipped at twice the graph calls' cost: unclipped it held the
    depth cost at ms for good (it decays only on steps that draft, which it prevented)."""
    policy = AcceptancePolicy(costs({1: 1000, 64: 1000}, draft=100))
    policy.choose([Candidate(AcceptanceCounts(), 100)], 3)
    policy.observe(StepRecord(num_scheduled=1, main_rows=2, commit_rows=[2], draft_rows=[1], clock_seconds=0.2,
                              clock_draft_seconds=0.06))  # fmt: skip
    assert 0 < policy.depth_extra_us <= 200 // 8 and 0 < policy.step_extra_us <= 2 * 1001 // 8


def test_a_deeper_depth_is_explored_now_and_then():
    """A depth never drafted is never measured: every EXPLORE_EVERY choices one request drafts one deeper."""
    policy, good = AcceptancePolicy(costs({1: 1000, 64: 1000}, draft=850)), counts(*[(3, 3)] * 20)
    ks = [policy.choose([Candidate(good, 100)], 3) for _ in range(2 * EXPLORE_EVERY)]
    assert [i for i, k in enumerate(ks) if k != [1]] == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert ks[EXPLORE_EVERY - 1] == [2]


def test_cost_curve_interpolates_in_integers_and_never_falls():
    curve = CostCurve((1, 4, 8), monotone([100, 90, 500]))  # a noisy dip at 4 rows is flattened
    assert curve.micros == (100, 100, 500) and curve(0) == 0 and curve(2) == 100
    assert curve(6) == 300 and curve(16) == 1300 and all(isinstance(curve(n), int) for n in range(20))


def test_profile_times_every_graph_and_ranks_agree_on_the_maximum():
    engine = make_engine(3, per_request_draft_tokens=True)  # the engine profiles its executor at creation
    model = engine.verify_lengths.cost
    assert model.main.rows == tuple(main_rows(engine.cfg.max_batch * 4))  # verify rows up to a full K=3 batch
    for curve in (model.main, model.draft, model.commit):
        assert min(curve.micros) > 0 and list(curve.micros) == sorted(curve.micros)
    other = model.with_micros([u + 7 for u in model.to_array().tolist()])
    agreed = agree(model, lambda mine: [mine, other.to_array()])  # what an allgather over two ranks returns
    assert agreed == other and agree(other, lambda mine: [model.to_array(), mine]) == other


def test_per_request_is_the_default():
    engine = create_engine(checkpoint="models/tiny", executor="torch", max_batch=2, max_num_tokens=32, max_seq_len=64,
                           num_blocks=32)  # fmt: skip
    assert engine.cfg.per_request_draft_tokens and isinstance(engine.verify_lengths, AcceptancePolicy)
    assert engine.draft_length is None  # auto stays available, not on by default


def test_fixed_pattern_is_capped():
    c = AcceptanceCounts()
    assert FixedPattern((5, 2)).choose([Candidate(c, 10), Candidate(c, 2)], 3) == [3, 1]


def test_settled_policy_keeps_prefix_hits(reference):
    """Requests admitted without their MTP plane publish their blocks main-only, and those hit as they do at K=0:
    a prompt first seen after the policy settled on drafting nothing is served from the cache when it comes again
    (before, such blocks were never published and the server lost its prefix hits). The explorers (they keep their
    plane) never read a main-only block's draft entries, so their hits stop before such blocks."""
    policy = RecordingPolicy(costs({1: 1000, 64: 64000}, draft=5000))  # drafting never pays
    policy.kept = []
    engine, k0 = make_engine(3, verify_lengths=policy), make_engine(0)
    assert run(engine) == reference and policy.settled_on_nothing
    fresh = random_prompts((21, 17, 26, 9, 30, 13, 19), seed=11)  # 7: the explorers move between rounds
    hits = {}
    for e in (k0, engine, k0, engine):  # the second time, each prompt is a repeat
        outs = e.generate(fresh, PARAMS)
        e.kv.assert_no_leaks()
        hits[id(e)] = [o.num_cached_tokens for o in outs]
        assert [o.output_ids for o in outs] == hits.setdefault("ids", [o.output_ids for o in outs])
    kept = policy.kept[-len(fresh) :]
    assert kept.count(False) >= len(fresh) - 2  # all but the explorers start frozen
    frozen_hits = [(n, m) for n, m, keeps in zip(hits[id(engine)], hits[id(k0)], kept, strict=True) if not keeps]
    assert all(n == m for n, m in frozen_hits) and sum(m for _, m in frozen_hits) > 0
    before = policy.kept[-2 * len(fresh) : -len(fresh)]  # the first time: a frozen request published main-only
    misses = [n for n, keeps, kept_before in zip(hits[id(engine)], kept, before, strict=True) if keeps and not kept_before]
    assert misses and all(n == 0 for n in misses)  # an explorer never reads main-only blocks
