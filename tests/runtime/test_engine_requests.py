"""Request state: per-request generators, delta outputs, finished requests leave the engine, and a failure
traceable to one request aborts that request alone (the batch mates finish, token-identical)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.core.request import ChunkCarry
from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import make_engine, random_prompts

PROMPTS = random_prompts((6, 11, 4, 9), seed=7)
GREEDY = SamplingParams(max_tokens=10)


def finals(engine, prompts, params, ids=None):
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(p, params, req_id=rid)
    out = {o.req_id: o for o in engine.stream() if o.finished}
    return [out[i] for i in ids]


@pytest.mark.parametrize("k", [0, 2])
def test_unseeded_sample_does_not_depend_on_batch_mates(k):
    """Each request samples from a generator derived from (engine seed, request id)."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    alone = finals(make_engine(k), [PROMPTS[0]], params, ["x"])[0].output_ids
    crowd = finals(make_engine(k), PROMPTS[1:] + [PROMPTS[0]], params, ["a", "b", "c", "x"])[3].output_ids
    assert alone == crowd
    other_seed = make_engine(k)
    other_seed.seed = 1
    assert finals(other_seed, [PROMPTS[0]], params, ["x"])[0].output_ids != alone  # the engine seed matters


def test_outputs_are_deltas_with_snapshot_accessors():
    engine = make_engine(2)
    engine.add_request(PROMPTS[1], GREEDY, req_id="r")
    outs = [o for o in engine.stream() if o.req_id == "r"]
    streamed = [t for o in outs for t in o.new_token_ids]
    assert streamed == outs[-1].output_ids and len(streamed) == GREEDY.max_tokens
    total = 0
    for o in outs:  # an output kept from an earlier step still reads as of that step
        total += len(o.new_token_ids)
        assert o.output_ids == streamed[:total] and len(o.accepted_per_step) == o.num_steps
    assert sum(outs[-1].accepted_per_step) <= outs[-1].num_proposed


def test_finished_requests_leave_the_engine():
    engine = make_engine(1)
    for _ in range(3):  # the same ids again: a finished request no longer holds its id (nor its memory)
        finals(engine, PROMPTS, GREEDY)
        assert engine.requests == {}
    engine.kv.assert_no_leaks()


class PoisonLogits:
    """Fault injection around the real executor: NaN logits for one request's rows from a given step on."""

    def __init__(self, inner, victim: str, from_step: int) -> None:
        self.inner, self.victim, self.from_step, self.step = inner, victim, from_step, 0
        self.engine = None  # set once the engine exists (its KV manager says which rows are the victim's)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_main(self, inp):
        out = self.inner.run_main(inp)
        self.step += 1
        if self.step >= self.from_step and self.engine.kv.has_request(self.victim):
            # the victim's packed rows are those of the request whose block table is its own
            first_block = self.engine.kv.block_table(self.victim)[0]
            starts = np.concatenate([[0], np.cumsum(inp.q_counts)])
            for r in np.flatnonzero(inp.block_tables[:, 0] == first_block):
                mine = (inp.logit_rows >= starts[r]) & (inp.logit_rows < starts[r + 1])
                out.logits[mine] = np.nan
        return out


@pytest.mark.parametrize("k", [0, 3])
def test_non_finite_logits_abort_only_that_request(k):
    reference = [o.output_ids for o in finals(make_engine(k), PROMPTS, GREEDY)]
    poison: list[PoisonLogits] = []
    engine = make_engine(k, enable_prefix_caching=False,
                         wrap=lambda ex: poison.append(PoisonLogits(ex, "r1", from_step=4)) or poison[0])  # fmt: skip
    poison[0].engine = engine
    outs = finals(engine, PROMPTS, GREEDY)
    assert outs[1].finish_reason == "error" and "non-finite logits" in outs[1].error
    assert outs[1].output_ids == reference[1][: len(outs[1].output_ids)]  # what it emitted before is kept
    assert [o.output_ids for i, o in enumerate(outs) if i != 1] == reference[:1] + reference[2:]
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1 and engine.requests == {}


def test_inconsistent_chunk_carry_aborts_only_that_request():
    reference = [o.output_ids for o in finals(make_engine(2), PROMPTS, GREEDY)]
    engine = make_engine(2, max_prefill_chunk=3)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, req_id=f"r{i}")
    victim = engine.requests["r3"]
    for _ in range(20):  # one partial chunk per step: wait until the victim is between two chunks
        engine.step()
        if victim.spec.carry is not None:
            break
    assert victim.spec.carry is not None
    victim.spec.carry = ChunkCarry(victim.spec.carry.position + 1, victim.spec.carry.hidden)  # off by one
    out = {o.req_id: o for o in engine.stream() if o.finished}
    assert out["r3"].finish_reason == "error" and "chunk carry" in out["r3"].error
    assert [out[f"r{i}"].output_ids for i in range(3)] == reference[:3]
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1
