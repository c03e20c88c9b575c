"""Invariants 1, 2, 6, 7, 8: every KV write of every step is recorded (block, slot, plane, provenance),
and after each step every committed position's MTP entry comes from a main hidden paired with t_{p+1}."""

from __future__ import annotations

import random

import pytest

from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import make_recorded_engine, random_prompts


def last_mtp_writes(writes):
    last = {}
    for w in writes:
        if w.plane == "mtp":
            last[(w.block, w.slot)] = w
    return last


def run_and_check(k, chunk, lengths, seed, commit_pass=True, max_batch=3, budget=24, **kw):
    engine, rec = make_recorded_engine(k, max_prefill_chunk=chunk, max_batch=max_batch, max_num_tokens=budget,
                                       commit_pass=commit_pass, num_blocks=120, **kw)  # fmt: skip
    prompts = random_prompts(lengths, seed=seed)
    prompts.append(prompts[0] + prompts[-1])  # shares prompt 0 as a prefix
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12))
    violations = []
    while engine.has_unfinished():
        engine.step()
        # invariant 8: real rows write only real blocks the request owns exclusively, never published ones
        assert not rec.ownership_violations, rec.ownership_violations[:5]
        assert not rec.segment_violations, rec.segment_violations[:5]
        last = last_mtp_writes(rec.writes)
        for req in engine.scheduler.running:
            table, bs = engine.kv.block_table(req.req_id), engine.cfg.block_size
            base = req.spec.mtp_exact_end(req.num_computed)  # carried positions are not final yet (a k = 0 step
            # may carry several: mtp_plan.plan_step)
            for p in range(base):
                w = last.get((table[p // bs], p % bs))
                if w is None or w.hidden_source != "main" or w.token != req.token_ids[p + 1]:
                    violations.append((req.req_id, p, None if w is None else (w.kind, w.hidden_source)))
            # invariant 7: a still-chunking request never drafts
            if req.spec.carry is not None:
                assert not req.spec.drafts
    engine.kv.assert_no_leaks()
    return violations, rec.writes


@pytest.mark.parametrize("seed", range(6))
def test_every_committed_position_holds_a_main_hidden_entry(seed):
    rnd = random.Random(seed)
    k = rnd.choice([1, 2, 3])
    chunk = rnd.choice([2, 3, 5, 7, 64])
    lengths = [rnd.randint(1, 20) for _ in range(rnd.randint(2, 5))]
    violations, writes = run_and_check(k, chunk, lengths, seed)
    assert not violations, violations[:5]
    # invariant 1: depth d writes base-1+d; depth 0 pairs with the base token (a main-hidden entry)
    assert any(w.kind == "draft0" for w in writes) and any(w.kind == "commit" for w in writes)
