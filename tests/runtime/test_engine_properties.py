"""Property test over whole-engine schedules (hypothesis): random prompts (with shared prefixes and
repeats), K, chunk size, token budget, batch limit, pool size (preemption), prefix caching on/off/COW.

For every generated schedule: greedy outputs equal the K=0 reference, every committed position's MTP
entry is a main-hidden entry paired with t_{p+1}, every write lands in an exclusively owned block, one
commit segment per request, and the block pool ends all-free with consistent reference counts.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import make_engine, make_recorded_engine

_REFERENCE: dict[tuple[int, ...], list[int]] = {}
MAX_TOKENS = 10


def reference(prompts: list[list[int]]) -> list[list[int]]:
    todo = [p for p in prompts if tuple(p) not in _REFERENCE]
    if todo:
        engine = make_engine(0, enable_prefix_caching=False, max_batch=8, max_num_tokens=256, num_blocks=400)
        for p, out in zip(todo, engine.generate(todo, SamplingParams(max_tokens=MAX_TOKENS)), strict=True):
            _REFERENCE[tuple(p)] = out.output_ids
    return [_REFERENCE[tuple(p)] for p in prompts]


@st.composite
def workloads(draw):
    base = draw(st.lists(st.integers(0, 95), min_size=1, max_size=24))
    prompts = []
    for _ in range(draw(st.integers(1, 5))):
        cut = draw(st.integers(1, len(base)))
        tail = draw(st.lists(st.integers(0, 95), max_size=6))
        prompts.append(base[:cut] + tail)  # shared prefixes of random lengths, sometimes identical prompts
    k = draw(st.integers(0, 3))
    caching = draw(st.sampled_from(["off", "give_up", "cow"]))
    return dict(
        prompts=prompts,
        k=k,
        max_prefill_chunk=draw(st.integers(1, 12)),
        max_batch=draw(st.integers(1, 4)),
        budget_slack=draw(st.integers(0, 8)),
        num_blocks=draw(st.sampled_from([16, 24, 64])),  # 16 and 24 force preemption
        caching=caching,
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_schedules_are_lossless_and_keep_the_invariants(w):
    k = w["k"]
    engine, rec = make_recorded_engine(
        k, max_prefill_chunk=w["max_prefill_chunk"], max_batch=w["max_batch"],
        max_num_tokens=w["max_batch"] * (1 + k) + w["budget_slack"], num_blocks=w["num_blocks"], max_seq_len=48,
        enable_prefix_caching=w["caching"] != "off", prefix_cache_cow=w["caching"] == "cow",
    )  # fmt: skip
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in w["prompts"]]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.req_id] = out.output_ids
        assert not rec.ownership_violations, rec.ownership_violations[:3]
        assert not rec.segment_violations, rec.segment_violations[:3]
        last = {}
        for wr in rec.writes:
            if wr.plane == "mtp":
                last[(wr.block, wr.slot)] = wr
        for req in engine.scheduler.running:
            if not k:
                continue
            table, bs = engine.kv.block_table(req.req_id), engine.cfg.block_size
            final = req.num_computed - (1 if req.spec.carry is not None else 0)
            for p in range(final):
                entry = last.get((table[p // bs], p % bs))
                assert entry is not None and entry.hidden_source == "main" and entry.token == req.token_ids[p + 1], (
                    f"{req.req_id} position {p}: {entry}"
                )
    assert [finals[i] for i in ids] == reference(w["prompts"])
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1
