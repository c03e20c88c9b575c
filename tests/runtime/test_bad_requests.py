"""Bad requests are rejected alone with a message naming the problem; the others finish; no block leaks."""

from __future__ import annotations

import re

import numpy as np
import pytest

from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.engine import RequestError
from runtime.core.sampling import SamplingParams
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
# Issue 8 item 2: each of these used to pass add_request and then make every engine.step() raise (or,
# for the prompts, be silently reinterpreted), stalling the good requests queued with it.
BAD_TYPES = [
    ([1, 2], SamplingParams(temperature=1.0, top_k=2.5), "top_k=2.5"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(temperature=1.0, top_k=True), "top_k=True"),
    ([1, 2], SamplingParams(temperature=1.0, top_k="5"), "top_k='5'"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(temperature=float("inf")), "temperature=inf"),
    ([1, 2], SamplingParams(temperature="0.7"), "temperature='0.7'"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(temperature=None), "temperature=None"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(temperature=1.0, top_p=float("nan")), "top_p=nan"),
    ([1, 2], SamplingParams(temperature=1.0, top_p="0.9"), "top_p='0.9'"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(temperature=1.0, seed=2**64), "seed="),
    ([1, 2], SamplingParams(temperature=1.0, seed=1.5), "seed=1.5"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(temperature=1.0, seed=-1), "seed=-1"),
    ([1, 2], SamplingParams(max_tokens=2.5), "max_tokens=2.5"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(max_tokens="8"), "max_tokens='8'"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(end_id=3.0), "end_id=3.0"),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(stop=("a", 3)), "stop="),  # type: ignore[arg-type]
    ([1, 2], SamplingParams(acceptance=["exact"]), "acceptance="),  # type: ignore[arg-type]
    ([1, 2], {"temperature": 1.0}, "must be a SamplingParams"),
    (b"\x01\x02", SamplingParams(), "prompt is bytes"),
    ([1.0, 2.0], SamplingParams(), "is not a token id"),
    ([1, 2.7], SamplingParams(), "is not a token id"),
    ([[1, 2], [3]], SamplingParams(), "is not a token id"),
    ([True, 2], SamplingParams(), "is not a token id"),
    (np.array([1.0, 2.0]), SamplingParams(), "1-D integer"),
    (np.array([[1, 2]]), SamplingParams(), "1-D integer"),
    (12, SamplingParams(), "must be a str or a list"),
    (None, SamplingParams(), "must be a str or a list"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_TYPES)
def test_bad_type_is_rejected_at_admission(prompt, params, message):
    """Rejected by add_request with a message naming the field; the good requests around it finish."""
    test_bad_request_is_rejected_alone(prompt, params, re.escape(message))


def test_numpy_integer_prompt_and_params_are_accepted():
    engine = make_engine(2)
    prompt = random_prompts((6,), seed=3)[0]
    ref = engine.generate([prompt], SamplingParams(max_tokens=5))[0].output_ids
    engine = make_engine(2)
    rid = engine.add_request([np.int64(t) for t in prompt], SamplingParams(max_tokens=np.int32(5), top_k=np.int64(0)))
    assert {o.req_id: o.output_ids for o in engine.stream() if o.finished}[rid] == ref
    engine = make_engine(2)
    rid = engine.add_request(np.array(prompt, dtype=np.int32), SamplingParams(max_tokens=5))
    assert {o.req_id: o.output_ids for o in engine.stream() if o.finished}[rid] == ref


def test_bad_request_id_is_rejected():
    engine = make_engine(1)
    for bad in (["x"], 7, ""):
        with pytest.raises(RequestError, match="request id"):
            engine.add_request([1, 2], req_id=bad)  # type: ignore[arg-type]
    assert not engine.requests


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_tiny_temperature_gives_no_nan(temperature):
    """logits / 1e-310 overflows to inf and inf - inf = NaN; the request must still run (argmax-like)."""
    engine = make_engine(2)
    prompt = random_prompts((6,), seed=4)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8))[0].output_ids
    engine = make_engine(2)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=temperature, seed=1))[0]
    assert out.output_ids == greedy  # random logits have no exact ties, so a near-zero temperature is argmax
    engine.kv.assert_no_leaks()


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
