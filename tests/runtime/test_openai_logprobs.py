"""logprobs / top_logprobs / echo through `mtp-serve --frontend openai` (models/tiny, torch, K=3, the real
`openai` client): the OpenAI shapes for completions and chat, streamed and whole, and the numbers: with MTP on
the logprobs of accepted drafts come from the verify forward, so they equal the in-process engine's with MTP
off (K=0) within float tolerance, prompt logprobs (echo) included."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest

from runtime.core.logprobs import log_softmax, token_logprobs
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.openai_helpers import TINY, client_fixture, server_fixture

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def __init__(self"]
TOL = 1e-4  # float32 logits of differently batched forwards (K=3 verify rows vs K=0 rows)


server = server_fixture("--num-draft-tokens", "3", "--per-request-spec-decode-metrics", "summary")
client = client_fixture(120)


@pytest.fixture(scope="module")
def mtp_off():
    return create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=0)


def test_token_logprobs_against_a_direct_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    out = token_logprobs(logits, [4, 9, 0], 5)
    ref = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for i, e in enumerate(out):
        assert e.logprob == pytest.approx(ref[i, e.token_id], abs=1e-12)
        assert list(e.top_ids) == list(np.argsort(-ref[i], kind="stable")[:5])
        assert e.top_logprobs == pytest.approx(sorted(ref[i], reverse=True)[:5], abs=1e-12)
    assert np.allclose(np.exp(log_softmax(logits)).sum(-1), 1.0)


def test_completion_logprobs_equal_mtp_off(client, mtp_off):
    accepted = 0
    for prompt in PROMPTS:
        ref = mtp_off.generate([prompt], SamplingParams(max_tokens=24, logprobs=5))[0]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=5)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == ref.text and "".join(lp.tokens) == ref.text
        assert len(lp.token_logprobs) == len(ref.output_ids) == r.usage.completion_tokens
        assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=TOL)
        for top, e, chosen in zip(lp.top_logprobs, ref.logprobs, lp.token_logprobs, strict=True):
            assert len(top) <= 5 and list(top.values()) == pytest.approx(list(e.top_logprobs)[: len(top)], abs=TOL)
            assert max(top.values()) == chosen  # greedy: the chosen token is the most likely one
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        accepted += r.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
    assert accepted > 0  # accepted drafts were among the tokens compared


def test_echo_with_prompt_logprobs_equals_mtp_off(client, mtp_off):
    prompt = PROMPTS[2]
    ids = list(mtp_off.tokenizer.encode(prompt).ids)
    ref = mtp_off.generate([prompt], SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=2))[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text == prompt + ref.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + len(ref.output_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expect = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expect, abs=TOL)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # n > 1: every choice echoes the prompt with its logprobs (computed once, by the prompt's first choice)
    two = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True,
                                    n=2)  # fmt: skip
    for ch in two.choices:
        assert ch.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expect[: len(ids) - 1], abs=TOL)
    # echo without logprobs: the prompt text only
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert plain.choices[0].text == prompt + ref.text and plain.choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt(client, mtp_off):
    """`echo` + `logprobs` + `max_tokens: 0` (lm-eval-harness's loglikelihood request, as vLLM serves it): the
    prompt back with its logprobs, nothing generated, finish "length"; the values are the engine's own prompt
    logprobs. Without echo and logprobs, 0 stays a 400 naming max_tokens; streamed, the same text."""
    prompt = PROMPTS[2]
    ids = list(mtp_off.tokenizer.encode(prompt).ids)
    ref = mtp_off.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert ref.output_ids == [] and len(ref.prompt_logprobs) == len(ids)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, temperature=0, logprobs=3, echo=True)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]], abs=TOL)
    for bad in ({}, {"echo": True}, {"logprobs": 1}):
        with pytest.raises(openai.BadRequestError, match="max_tokens=0: must be an int >= 1"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=0, temperature=0, **bad)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, temperature=0, logprobs=3,
                                            echo=True, stream=True))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt


def test_echo_with_logprobs_on_a_repeated_prompt(client):
    """Prompt logprobs need every prompt position computed: the request does not read the prefix cache."""
    prompt = PROMPTS[0] * 12
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=0, echo=True)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=0, echo=True)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(first.choices[0].logprobs.token_logprobs[1:],
                                                                           abs=TOL)  # fmt: skip
    assert None not in again.choices[0].logprobs.token_logprobs[1:]


def test_streamed_logprobs_equal_whole(client):
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0, logprobs=3)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            logprobs=3, stream=True))  # fmt: skip
    tokens = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    values = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert tokens == whole.choices[0].logprobs.tokens
    assert values == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=TOL)


def test_chat_logprobs_shape_and_values(client, mtp_off):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=20)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 20 and t.bytes == list(t.token.encode()) for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy
    for t in content:  # the 20 most likely, most likely first: a part of one distribution
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1.0 + 1e-9
    rendered = "<|user|>\ndef add(a, b):\n<|assistant|>\n"
    ref = mtp_off.generate([rendered], SamplingParams(max_tokens=16, logprobs=20))[0]
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=TOL)
    only = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in only.choices[0].logprobs.content)
    none = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))  # fmt: skip
    streamed = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content], abs=TOL)  # a prefix-cache hit: other batching


@pytest.mark.parametrize("kwargs, needle", [
    ({"logprobs": 21}, "logprobs=21"),
    ({"logprobs": -1}, "logprobs=-1"),
])  # fmt: skip
def test_completion_logprobs_out_of_range(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, **kwargs)
    assert needle in e.value.message


@pytest.mark.parametrize("kwargs, needle", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs=21"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
])  # fmt: skip
def test_chat_top_logprobs_out_of_range(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs)
    assert needle in e.value.message
