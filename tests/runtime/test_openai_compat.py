"""OpenAI compatibility of `mtp-serve --frontend openai`, driven by the real `openai` client on loopback
(models/tiny, torch, K=3): content parts, role check, `refusal: null`, token-id prompts (single and batched),
`max_tokens` beyond the context, `max_completion_tokens` precedence, n > 1 (seeded, sharing the prompt's KV),
/openapi.json matching the routes and the responses, `Allow` on 405, and no spec metrics unless asked for."""

from __future__ import annotations

import httpx2 as httpx
import jsonschema_rs
import openai
import pytest

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.openai_helpers import TINY, client_fixture, server_fixture

pytestmark = pytest.mark.timeout(300)
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 3


server = server_fixture("--num-draft-tokens", "3")
client = client_fixture(120)


@pytest.fixture(scope="module")
def local():
    return create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=3)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, **kw)


def test_content_parts_equal_the_joined_string(client):
    parts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "    return"}]
    r = _chat(client, [{"role": "system", "content": [{"type": "text", "text": "You write Python."}]},
                       {"role": "user", "content": parts}])  # fmt: skip
    plain = _chat(client, [{"role": "system", "content": "You write Python."}, {"role": "user", "content": parts}])
    assert r.choices[0].message.content == plain.choices[0].message.content
    with_system = _chat(client, [{"role": "system", "content": "You write Python."},
                                 {"role": "user", "content": "def add(a, b):\n    return"}])  # fmt: skip
    assert r.choices[0].message.content == with_system.choices[0].message.content != ""


@pytest.mark.parametrize("message, needle, param", [
    ({"role": "wizard", "content": "hi"}, "role 'wizard'", "messages.0.role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}, "'image_url'",
     "messages.0.content.0.type"),
    ({"role": "user", "content": "hi", "tool_calls": []}, "tool_calls", None),
])  # fmt: skip
def test_bad_messages_are_400_naming_the_field(server, message, needle, param):
    r = _post(server, "/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_chat_message_has_refusal_null(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    msg = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and "refusal" in msg and msg["refusal"] is None


def test_token_id_prompts_single_and_batched(client, local):
    ids = [list(local.tokenizer.encode(p).ids) for p in ("def main(", "import os\n")]
    refs = [local.generate([i], SamplingParams(max_tokens=8))[0] for i in ids]
    single = client.completions.create(model="tiny", prompt=ids[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == refs[0].text and single.usage.prompt_tokens == len(ids[0])
    batch = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [r.text for r in refs]
    assert batch.usage.prompt_tokens == sum(map(len, ids)) and batch.usage.completion_tokens == 16
    strings = client.completions.create(model="tiny", prompt=["def main(", "import os\n"], max_tokens=8, temperature=0)
    assert [c.text for c in strings.choices] == [r.text for r in refs]


@pytest.mark.parametrize("prompt", [{"a": 1}, [1, "x"], [[1, 2], "x"], [True], 5])
def test_bad_prompt_types_get_one_clear_message(server, prompt):
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert "list of token ids" in err["message"] and "prompt.str" not in err["message"]


def test_max_tokens_beyond_the_context_is_400_with_the_context_length(client, local):
    n = len(local.tokenizer.encode("hi").ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=600)
    assert "maximum context length is 512 tokens" in e.value.message and f"{n + 600} tokens" in e.value.message
    assert e.value.body["param"] == "max_tokens"
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=512 - n, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = client.completions.create(model="tiny", prompt="def main(", max_tokens=9, temperature=0,
                                  extra_body={"max_completion_tokens": 3})  # fmt: skip
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=5, extra_body={"max_completion_tokens": 0})
    assert "max_completion_tokens=0" in e.value.message and e.value.body["param"] == "max_completion_tokens"
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=9,
                                       max_completion_tokens=2, temperature=0)  # fmt: skip
    assert c.usage.completion_tokens == 2


def test_n_choices_are_seeded_reproducible_and_share_the_prompt_kv(client, server):
    kw = {"model": "tiny", "prompt": LONG, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7}
    before = server.metrics()["mtp_prefix_cache_hit_tokens_total"]
    first = client.completions.create(**kw)
    hits = server.metrics()["mtp_prefix_cache_hit_tokens_total"] - before
    again = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # choice i samples with seed + i
    one = client.completions.create(**{**kw, "n": 1, "seed": 8})
    assert one.choices[0].text == first.choices[1].text
    # choices 1 and 2 start after choice 0 prefilled: each reads the prompt's full blocks from the prefix cache
    assert hits >= 2 * 32, hits
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 32  # the prompt counts once
    assert first.usage.completion_tokens == 36


def test_n_choices_stream_with_their_index(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, n=2, stream=True))  # fmt: skip
    by_index = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            by_index[c.index] += c.delta.content or ""
    assert by_index[0] == by_index[1] != ""  # greedy: both choices are the same text
    assert sorted(c.index for ch in chunks for c in ch.choices if c.finish_reason) == [0, 1]


def test_405_carries_allow(server):
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/models", timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_openapi_matches_the_routes_and_the_responses(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.")
    documented = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    assert documented == {("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                          ("/health", "GET"), ("/metrics", "GET"), ("/openapi.json", "GET")}  # fmt: skip
    for path, method in documented:  # every documented route is served (nothing 404 / 405)
        body = {"prompt": "hi", "max_tokens": 2} if "completions" in path else None
        if path.endswith("chat/completions"):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.request(method, server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.status_code)
        schema = doc["paths"][path][method.lower()]["responses"]["200"]["content"]
        if "application/json" in schema and path != "/openapi.json":
            _validate(doc, schema["application/json"]["schema"], r.json())
    bad = _post(server, "/v1/completions", {"prompt": "hi", "frequency_penalty": 1})
    _validate(doc, doc["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"],
              bad.json())  # fmt: skip
    full = _post(server, "/v1/completions", {"prompt": "def main(", "max_tokens": 4, "logprobs": 2, "echo": True, "n": 2})
    _validate(doc, {"$ref": "#/components/schemas/CompletionResponse"}, full.json())
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "logprobs": True, "top_logprobs": 3})  # fmt: skip
    _validate(doc, {"$ref": "#/components/schemas/ChatCompletionResponse"}, chat.json())
    with pytest.raises(jsonschema_rs.ValidationError):  # the check can fail: a response missing a field
        _validate(doc, {"$ref": "#/components/schemas/ChatCompletionResponse"}, {**chat.json(), "choices": [{}]})


def _validate(doc: dict, schema: dict, instance) -> None:
    jsonschema_rs.validate({**schema, "components": doc["components"]}, instance)


def test_spec_metrics_are_opt_in(client):
    r = client.completions.create(model="tiny", prompt="def main(", max_tokens=8, temperature=0)
    assert "metrics" not in (r.model_extra or {}) and "spec_decoding" not in (r.model_extra or {})
