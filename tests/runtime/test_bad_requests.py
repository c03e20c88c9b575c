"""Bad requests are rejected alone with a message naming the problem; the others finish; no block leaks."""

from __future__ import annotations

import pytest

from runtime.config import ConfigError, RuntimeConfig
from runtime.engine import RequestError
from runtime.sampling import SamplingParams
from tests.runtime.engine_utils import make_engine, random_prompts

BAD = [
    ([], SamplingParams(), "empty prompt"),
    ([1] * 130, SamplingParams(), "max_seq_len"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p"),
    ([1, 500], SamplingParams(), "outside the vocabulary"),
    ([1, -3], SamplingParams(), "outside the vocabulary"),
    ("text", SamplingParams(), "no tokenizer"),
]


@pytest.mark.parametrize("prompt,params,message", BAD)
def test_bad_request_is_rejected_alone(prompt, params, message):
    engine = make_engine(2)
    good = random_prompts((7, 4), seed=1)
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in good[:1]]
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)
    ids.append(engine.add_request(good[1], SamplingParams(max_tokens=6)))
    finished = {o.req_id: o for o in engine.stream() if o.finished}
    assert set(finished) == set(ids) and all(len(finished[i].output_ids) == 6 for i in ids)
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1


def test_abort_frees_blocks():
    engine = make_engine(3)
    a = engine.add_request(random_prompts((9,))[0], SamplingParams(max_tokens=50))
    b = engine.add_request(random_prompts((5,), seed=2)[0], SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    req = engine.requests[a]
    engine.abort(a)
    finished = [o for o in engine.stream() if o.finished]
    assert [o.req_id for o in finished] == [b]
    assert req.finish_reason == "abort" and a not in engine.requests
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1


def test_duplicate_request_id_rejected():
    engine = make_engine(1)
    engine.add_request([1, 2, 3], req_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([4, 5], req_id="x")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_draft_tokens=4, block_size=4), "block_size"),
        (dict(max_batch=8, max_num_tokens=16, num_draft_tokens=3), "max_num_tokens"),
        (dict(num_blocks=1), "num_blocks"),
    ],
)
def test_bad_runtime_config(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RuntimeConfig(**kwargs)


def test_stop_conditions():
    engine = make_engine(2)
    prompt = random_prompts((6,), seed=5)[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=12))[0].output_ids
    engine = make_engine(2)
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, end_id=full[4]))[0]
    first = full.index(full[4])
    assert stopped.output_ids == full[: first + 1] and stopped.finish_reason == "stop"
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1
