"""Per-request verify lengths (--num-draft-tokens per-request): ragged draft loops and verifies stay lossless
(greedy ids equal K=0's with chunked prefill, prefix hits and preemption), and the policy is exact,
deterministic, capped by each request's remaining tokens and breaks ties by position."""

from __future__ import annotations

from fractions import Fraction

import pytest

from runtime.core.sampling import SamplingParams
from runtime.core.verify_lengths import AcceptanceCounts, AcceptancePolicy, Candidate, FixedPattern, RowCost
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
    proposed = engine.metrics.proposed_per_position
    assert proposed[0] > 0  # it drafted, and not a fixed K for everyone at every step
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


def test_policy_follows_acceptance_and_remaining_tokens():
    good, bad = counts(*[(3, 3)] * 20), counts(*[(3, 0)] * 20)
    policy = AcceptancePolicy()
    assert policy.choose([Candidate(good, 100), Candidate(bad, 100)], 3) == [3, 0]
    # the tail of a closed batch: at most remaining - 1 drafts (the verify emits k + 1 tokens at most)
    assert policy.choose([Candidate(good, 2), Candidate(good, 1), Candidate(good, 0)], 3) == [1, 0, 0]


def test_policy_budget_ties_go_to_the_earlier_request():
    same = [Candidate(counts(*[(3, 2)] * 10), 50) for _ in range(3)]
    ks = AcceptancePolicy(RowCost(min_gain=Fraction(0), max_rows=4)).choose(same, 3)
    assert ks == [2, 1, 1]  # 4 rows: every depth 0 by position, then request 0's depth 1 (equal gains)
    assert AcceptancePolicy(RowCost(min_gain=Fraction(0), max_rows=4)).choose(same, 3) == ks  # deterministic


def test_fixed_pattern_is_capped():
    c = AcceptanceCounts()
    assert FixedPattern((5, 2)).choose([Candidate(c, 10), Candidate(c, 2)], 3) == [3, 1]
