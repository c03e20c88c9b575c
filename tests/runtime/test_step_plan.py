"""plan_step is pure: built from the verify results, it changes no request state, and planning twice gives
the same plan (so commit and apply may run in either order)."""

from __future__ import annotations

import copy

import numpy as np

from runtime.core.accept import accept_all
from runtime.core.mtp_plan import plan_main, plan_step, table_array
from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import make_engine, random_prompts


def state(req):
    s = req.spec
    carry = None if s.carry is None else (s.carry.position, s.carry.hidden.tolist())
    return (list(req.token_ids), req.num_computed, list(s.drafts), carry, req.status)


def test_plan_step_is_pure_and_deterministic():
    engine = make_engine(2, max_prefill_chunk=4)
    for p in random_prompts((9, 3, 14), seed=4):
        engine.add_request(p, SamplingParams(max_tokens=8))
    checked = 0
    for _ in range(6):  # a mix of chunk seams, first tokens and decode steps
        engine.step()
        if not engine.has_unfinished():
            break
        sched = engine.scheduler.schedule()
        tables = table_array([engine.kv.block_table(s.req.req_id) for s in sched.scheduled], engine.width)
        main_plan = plan_main(sched.scheduled, tables)
        main = engine.executor.run_main(main_plan.inp)
        accepted, nxt, errors = accept_all(sched.scheduled, main_plan, main.logits)
        before = [copy.deepcopy(state(s.req)) for s in sched.scheduled]
        plans = [plan_step(sched.scheduled, main_plan, main.hidden, accepted, nxt, errors=errors, mtp=True)
                 for _ in range(2)]  # fmt: skip
        assert [state(s.req) for s in sched.scheduled] == before
        a, b = plans
        assert [(u.num_computed, u.emit, u.draft_row) for u in a.updates] == [
            (u.num_computed, u.emit, u.draft_row) for u in b.updates]
        assert len(a.commits) == len(b.commits)
        for ca, cb in zip(a.commits, b.commits, strict=True):
            assert np.array_equal(ca.token_ids, cb.token_ids)
            assert np.array_equal(ca.hidden_in, cb.hidden_in)
        checked += bool(a.commits)
        # the rewind is base = start + n + a, whatever the request state says
        for s, u, acc in zip(sched.scheduled, a.updates, accepted, strict=True):
            assert u.num_computed == s.start + s.num_new_tokens + acc
        # nothing was applied, so the next engine.step() recomputes this step's rows (same tokens, same KV)
    assert checked
