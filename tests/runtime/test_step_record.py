"""The step record (runtime/core/step_record.py): what a real engine's steps publish matches what they did (the
executor calls they made, the acceptance each request recorded), and the metrics, auto's cost cycles, the bench
and the serving statistics are exactly the records' figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from runtime.core.draft_length import DraftLengthController
from runtime.core.sampling import SamplingParams
from runtime.core.step_record import PHASES, StepRecord
from runtime.core.verify_lengths import FixedPattern
from runtime.serving.openai.metrics import _EngineCollector
from runtime.serving.stats import Counts, take
from tests.runtime.engine_utils import make_engine, random_prompts


@dataclass
class CallRows:
    """Wraps the real executor; per step, the rows of each call (a step starts with its main call)."""

    inner: object
    steps: list[dict] = field(default_factory=list)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_main(self, inp):
        self.steps.append({"main": len(inp.input_ids), "commit": [], "draft": []})
        return self.inner.run_main(inp)

    def run_commit(self, inp):
        self.steps[-1]["commit"].append(len(inp.token_ids))
        return self.inner.run_commit(inp)

    def run_draft(self, inp):
        self.steps[-1]["draft"].append(int(inp.counts.sum()))
        return self.inner.run_draft(inp)


def run_recorded(engine, prompts, max_tokens=10):
    """Step the prompts to completion; returns each step's (record, outputs)."""
    records: list[StepRecord] = []
    engine.step_listeners.append(records.append)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens))
    steps = []
    while engine.has_unfinished():
        outs = engine.step()
        assert engine.last_step is records[-1]
        steps.append((records[-1], outs))
    return steps


def check_against_the_step(record: StepRecord, calls: dict, outs, history: dict[str, int]) -> None:
    """One step's record against its executor calls and outputs (history: accepted_per_step lengths so far)."""
    assert record.num_scheduled > 0
    assert (record.main_rows, record.commit_rows, record.draft_rows) == (calls["main"], calls["commit"], calls["draft"])
    verified = {}
    for o in outs:  # a request that verified this step has one more accepted_per_step entry: the record's
        if len(o.accepted_per_step) > history.get(o.req_id, 0):
            verified[o.req_id] = o.accepted_per_step[-1]
        history[o.req_id] = len(o.accepted_per_step)
    assert record.accepted_per_request == verified
    assert record.proposed_per_request.keys() == verified.keys()
    assert all(0 <= a <= record.proposed_per_request[r] for r, a in verified.items())
    drafting = [o.req_id for o in outs if not o.finished]  # every unfinished output drafts next (no freeze here)
    assert record.num_drafting == len(drafting) and sorted(record.k_per_request) == sorted(drafting)
    depths = max(record.k_per_request.values(), default=0)  # (no request drafting: the loop runs no depth)
    assert len(record.draft_rows) == depths and (record.draft_depths == depths or not drafting)
    for d, rows in enumerate(record.draft_rows):  # depth d runs the requests with k_i > d
        assert rows == sum(k > d for k in record.k_per_request.values())
    assert record.num_generated_tokens == sum(len(o.new_token_ids) for o in outs)
    assert list(record.phase_seconds) == list(PHASES)
    assert min(record.phase_seconds.values()) >= 0.0
    assert sum(record.phase_seconds.values()) <= record.total_seconds
    assert 0.0 < record.executor_seconds <= record.total_seconds
    assert 0.0 <= record.clock_draft_seconds <= record.clock_seconds


@pytest.mark.parametrize("per_request", [False, True], ids=["K2", "ragged"])
def test_the_record_is_what_the_step_did(per_request):
    """K=2 (every drafting request k = 2) and ragged per-request k_i (0, 1, 2 in turn): rows per graph call, k and
    accepted drafts per request, requests drafting, tokens and phase times, step by step."""
    made: list[CallRows] = []
    policy = FixedPattern((0, 1, 2)) if per_request else None
    engine = make_engine(2, wrap=lambda ex: made.append(CallRows(ex)) or made[0], verify_lengths=policy,
                         max_prefill_chunk=6)  # fmt: skip
    steps = run_recorded(engine, random_prompts((9, 4, 13), seed=2))
    assert len(steps) == len(made[0].steps) > 4
    history: dict[str, int] = {}
    for (record, outs), calls in zip(steps, made[0].steps, strict=True):
        check_against_the_step(record, calls, outs, history)
        if not per_request:
            assert set(record.k_per_request.values()) <= {2}
    assert any(r.accepted_per_request for r, _ in steps) and any(r.commit_rows for r, _ in steps)
    if per_request:  # the pattern's ragged depths did show up
        assert any(0 < rows < r.num_drafting for r, _ in steps for rows in r.draft_rows)


def test_metrics_are_the_sums_of_the_records():
    engine = make_engine(2, auto_draft_tokens=True)
    steps = run_recorded(engine, random_prompts((7, 11), seed=5), max_tokens=12)
    records = [r for r, _ in steps]
    m = engine.metrics
    assert m.num_steps == len(records)
    assert m.step_seconds == pytest.approx(sum(r.total_seconds for r in records))
    assert m.executor_seconds == pytest.approx(sum(r.executor_seconds for r in records))
    assert m.num_generated_tokens == sum(r.num_generated_tokens for r in records)
    assert m.num_generated_tokens == sum(len(o.new_token_ids) for _, outs in steps for o in outs)
    assert m.num_verify_steps == sum(len(r.accepted_per_request) for r in records)
    assert m.num_emitted_tokens == sum(a + 1 for r in records for a in r.accepted_per_request.values())
    assert sum(m.accepted_per_position) == sum(sum(r.accepted_per_request.values()) for r in records)
    hist = [0] * 3
    for r in records:
        hist[r.draft_depths] += r.num_drafting > 0
    assert m.draft_length_counts == hist


def test_auto_learns_from_the_records_cycles():
    """auto's sample at step t is the cycle closed at t-1: step t-2's draft phase plus step t-1 but its draft
    phase, on the draft clock; with step t-2's depths and requests drafting and step t-1's verify rows."""

    class Seen(DraftLengthController):
        def __init__(self, k: int) -> None:
            super().__init__(k)
            self.seen: list[tuple[int, tuple]] = []
            self.script = iter([2, 0, 1, 2, 1] * 20)

        def observe(self, s) -> None:
            self.seen.append((len(records), (s.cycle_seconds, s.cycle_depths, s.cycle_drafting, s.cycle_rows)))
            super().observe(s)

        def choose(self, num_drafting, base_rows, remaining=None):
            return next(self.script) if num_drafting else 0

    records: list[StepRecord] = []
    ctl = Seen(2)
    engine = make_engine(2, auto_draft_tokens=True, draft_length=ctl)
    engine.step_listeners.append(records.append)
    for p in random_prompts((6, 10), seed=7):
        engine.add_request(p, SamplingParams(max_tokens=10))
    while engine.has_unfinished():
        engine.step()
    assert len(ctl.seen) > 4 and len({d for _, (_, d, _, _) in ctl.seen}) == 3  # every depth 0..2 was a cycle's
    for t, cycle in ctl.seen:
        prev = records[t - 2] if t >= 2 else StepRecord()
        last = records[t - 1] if t >= 1 else None
        if last is None:
            assert cycle == (0.0, 0.0, 0.0, 0.0)
            continue
        assert cycle == (prev.clock_draft_seconds + last.clock_seconds - last.clock_draft_seconds,
                         float(prev.draft_depths), float(prev.num_drafting), float(last.main_rows))  # fmt: skip


def test_the_bench_and_the_serving_statistics_read_the_records():
    from runtime.bench.runners import run_engine

    engine = make_engine(2)
    records: list[StepRecord] = []
    engine.step_listeners.append(records.append)
    res = run_engine(engine, random_prompts((5, 8), seed=3), 1, 6, "rec")
    decode = [r for r in records if r.accepted_per_request]  # batch 1: every step after the first token verifies
    assert res.decode_steps == len(decode) == len(records) - 2
    assert res.decode_seconds == pytest.approx(sum(r.total_seconds for r in decode))
    assert res.decode_cpu_seconds == pytest.approx(sum(r.cpu_seconds for r in decode))
    stats = take(engine, 0, 0, Counts())
    assert stats.last_step is records[-1]
    collector = _EngineCollector()
    collector.update(stats)
    gauges = {m.name: m.samples[0].value for m in collector.collect() if m.samples and m.type == "gauge"}
    assert gauges["mtp_step_seconds"] == records[-1].total_seconds
    assert gauges["mtp_spec_draft_length"] == records[-1].draft_depths
    assert gauges["mtp_spec_requests_drafting"] == records[-1].num_drafting
