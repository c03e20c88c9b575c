"""Structured output with MTP: `response_format` json_object / json_schema and vLLM's guided_regex /
guided_grammar / guided_choice through `mtp-serve --frontend openai` (models/tiny, torch, K=3, the real
`openai` client). A schema suite of our own (nested objects, enums, arrays, bounded numbers, required and
optional fields): every output parses and validates, greedy outputs equal the in-process engine's with MTP
off (K=0) under the same grammar, also at concurrency 8, and acceptance under a grammar is reported."""

from __future__ import annotations

import contextlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import openai
import pytest

from runtime.core.grammar import GrammarCompiler
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.openai_helpers import TINY, client_fixture, server_fixture
from tests.runtime.test_schema_support import REFUSED

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 96
PROMPTS = ["def main(", "import os\n", '{"']

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                  "id": {"type": "integer", "minimum": 0, "maximum": 999}},
                 "required": ["name", "id"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
              "required": ["color", "size"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1,
                   "maxItems": 4},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["scores", "tags"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"temp": {"type": "number", "minimum": -10, "maximum": 40},
                                                 "count": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["temp", "count"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"type": "string", "maxLength": 5}, "c": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False},
}  # fmt: skip
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'


server = server_fixture("--num-draft-tokens", "3", "--per-request-spec-decode-metrics", "summary")
client = client_fixture(300)


@pytest.fixture(scope="module")
def mtp_off():
    engine = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=0)
    return engine, GrammarCompiler(engine.tokenizer, engine.model_cfg.vocab_size, engine.model_cfg.eos_token_id)


def _fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": SCHEMAS[name]}}


def _complete(client, prompt: str, **kw):
    return client.completions.create(**{"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                        **kw})  # fmt: skip


CASES = [(name, prompt) for name in SCHEMAS for prompt in PROMPTS]


def test_schema_suite_validates_and_equals_mtp_off(client, mtp_off):
    engine, compiler = mtp_off
    steps = accepted = drafted = 0
    for name, prompt in CASES:
        r = _complete(client, prompt, extra_body={"response_format": _fmt(name)})
        text = r.choices[0].text
        jsonschema_rs.validate(SCHEMAS[name], json.loads(text))  # parses and validates
        assert r.choices[0].finish_reason == "stop", (name, prompt, text)
        ref = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, grammar=compiler.json_schema(SCHEMAS[name])))[0]
        assert text == ref.text and r.usage.completion_tokens == len(ref.output_ids), (name, prompt)
        spec = r.model_extra["metrics"]["speculative_decoding"]
        steps += spec["num_spec_steps"]
        accepted += spec["num_accepted_draft_tokens"]
        drafted += spec["num_draft_tokens"]
    print(f"\nunder a JSON schema ({len(CASES)} requests, K=3): acceptance {accepted}/{drafted} = "
          f"{accepted / drafted:.3f}, mean acceptance length {(accepted + steps) / steps:.2f}")
    assert steps > 0 and accepted > 0  # drafts were made and verified under the grammar


def test_chat_json_schema_and_json_object(client, mtp_off):
    messages = [{"role": "user", "content": "Give me a user as JSON."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       response_format=_fmt("nested"))  # fmt: skip
    jsonschema_rs.validate(SCHEMAS["nested"], json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].message.content.startswith("{")


def test_regex_grammar_and_choice(client, mtp_off):
    engine, compiler = mtp_off
    for prompt in PROMPTS:
        r = _complete(client, prompt, extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, r.choices[0].text), r.choices[0].text
        ref = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, grammar=compiler.regex(REGEX)))[0]
        assert r.choices[0].text == ref.text
        g = _complete(client, prompt, extra_body={"guided_grammar": EBNF}).choices[0].text
        assert re.fullmatch(r"\(([1-9][0-9]?)(\+[1-9][0-9]?)*\)", g), g
        c = _complete(client, prompt, extra_body={"guided_choice": ["yes", "no", "maybe"]}).choices[0].text
        assert c in ("yes", "no", "maybe")


def test_sampled_outputs_validate_and_streaming(client):
    for seed in range(4):
        r = _complete(client, PROMPTS[seed % 3], temperature=1.0, seed=seed,
                      extra_body={"response_format": _fmt("arrays")})  # fmt: skip
        jsonschema_rs.validate(SCHEMAS["arrays"], json.loads(r.choices[0].text))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"response_format": _fmt("enums")}))  # fmt: skip
    jsonschema_rs.validate(SCHEMAS["enums"], json.loads("".join(c.choices[0].text for c in chunks if c.choices)))


def test_concurrent_structured_requests_equal_sequential(client):
    """SGLang #32666 corrupted structured output at concurrency >= 2: here 8 at once equal one at a time."""
    cases = CASES[:8]
    sequential = [_complete(client, p, extra_body={"response_format": _fmt(n)}).choices[0].text for n, p in cases]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: _complete(client, c[1], extra_body={"response_format": _fmt(c[0])})
                                 .choices[0].text, cases))  # fmt: skip
    assert together == sequential


@pytest.mark.parametrize("extra, needle, param", [
    ({"guided_regex": "([a-z"}, "regex does not compile", "guided_regex"),
    ({"guided_grammar": "root ::= "}, "grammar does not compile", "guided_grammar"),
    ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "send one", "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema",
     "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type"),
])  # fmt: skip
def test_bad_constraints_are_400(client, extra, needle, param):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "hi", extra_body=extra)
    assert needle in e.value.message and e.value.body["param"] == param
    assert "/project/cpp" not in e.value.message


@pytest.mark.parametrize("schema, keyword, path", [case[:3] for case in REFUSED],
                         ids=[f"{k}@{p}" for _, k, p, _ in REFUSED])  # fmt: skip
def test_a_schema_keyword_the_grammar_cannot_enforce_is_400_naming_it(client, schema, keyword, path):
    """xgrammar drops these with a log warning only: outputs broke the schema (or an unsatisfiable one got 200 and a
    number) with finish_reason "stop". Now the request is refused before anything compiles, naming keyword and path."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "hi", max_tokens=2, extra_body={"response_format": fmt})
    assert f"`{keyword}` at {path} is not enforced" in e.value.message and e.value.body["param"] == "response_format"


def test_guided_json_and_chat_refuse_the_same_keywords(client):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "hi", max_tokens=2, extra_body={"guided_json": json.dumps({"not": {}})})
    assert "`not` at # is not enforced" in e.value.message and e.value.body["param"] == "guided_json"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError, match="`uniqueItems` at # is not enforced"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format=fmt)  # fmt: skip


def test_an_engine_failure_reaches_the_client_as_an_error(client):
    """A grammar that admits no token (a left recursion with no way out): the engine aborts that request alone ("the
    grammar refused emitted token ..."). The client used to get 200, empty text and finish_reason "stop"; now a 500
    naming the failure, or an error event in a stream, and the server goes on serving. (The JSON schema that did
    this, {"$ref": "#"}, is now refused up front: test_a_schema_keyword_the_grammar_cannot_enforce_is_400_naming_it.)"""
    bad = {"guided_grammar": 'root ::= root "a"'}
    with pytest.raises(openai.InternalServerError) as e:
        _complete(client, "hi", max_tokens=8, extra_body=bad)
    assert "grammar refused" in e.value.message, e.value.message
    stream = client.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=0, stream=True,
                                       extra_body=bad)  # fmt: skip
    with pytest.raises(openai.APIError, match="grammar refused"):
        for chunk in stream:
            assert chunk.choices[0].finish_reason != "stop", chunk
    assert _complete(client, "def main(", max_tokens=4).choices[0].finish_reason == "length"


def test_the_compiled_grammar_cache_keeps_to_its_budget(mtp_off):
    """xgrammar's cache had no bound (1,600 distinct schemas: 621 -> 1,509 MiB with no plateau). With a budget it
    evicts; without one (-1) the same schemas keep growing it, so this test can fail."""
    engine, _ = mtp_off
    budget = 64 << 10
    sizes = {}
    for limit in (budget, -1):
        compiler = GrammarCompiler(engine.tokenizer, engine.model_cfg.vocab_size, engine.model_cfg.eos_token_id,
                                   cache_limit_bytes=limit)  # fmt: skip
        for i in range(120):  # distinct schemas: nothing is a cache hit
            compiler.json_schema({"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(4)},
                                  "required": [f"field_{i}_0"]})  # fmt: skip
        sizes[limit] = compiler.cache_size_bytes
    assert sizes[-1] > 4 * budget, sizes  # the schemas do fill an unbounded cache
    assert sizes[budget] <= 1.5 * budget, sizes  # "may slightly exceed" (xgrammar)


def test_grammar_cache_flag_is_checked_before_the_engine_loads():
    from types import SimpleNamespace

    from runtime.core.config import ConfigError
    from runtime.serving.openai.server import build_state

    with pytest.raises(ConfigError, match="--grammar-cache-mb must be > 0, got 0"):
        build_state(SimpleNamespace(grammar_cache_mb=0))  # no engine: it would fail on anything else first


def _wide_schema(n: int, tag: str) -> dict:
    """n optional string properties: xgrammar's compile time grows about as n^2 (400: 0.3 s on models/tiny's
    vocabulary, 800: over a second on the 2-core machine); `tag` makes it a cache miss."""
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(n)}}


def _schema_request(schema: dict):
    from runtime.serving.openai import protocol as P

    return P.parse(P.CompletionRequest, json.dumps({"prompt": "x", "guided_json": schema}).encode())


def test_a_constraint_over_the_byte_limit_is_400_before_compiling(client):
    big = _wide_schema(1500, "big")  # ~40 KB, over the default 32 KiB
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "hi", max_tokens=2, extra_body={"guided_json": big})
    assert "over this server's 32768 (--grammar-max-bytes)" in e.value.message and e.value.body["param"] == "guided_json"


def test_a_slow_compile_is_400_and_a_compile_that_cannot_start_is_503(mtp_off):
    import asyncio

    from runtime.serving.openai.protocol import ProtocolError
    from runtime.serving.openai.structured import Structured

    engine, _ = mtp_off
    structured = Structured(engine.tokenizer, engine.model_cfg.vocab_size, list(engine.model_cfg.eos_token_id),
                            timeout_s=0.05)  # fmt: skip

    async def go():
        jobs = [structured.grammar_of(_schema_request(_wide_schema(800, f"s{i}"))) for i in range(3)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(go())
    assert all(isinstance(r, ProtocolError) for r in results), results
    statuses = sorted(r.status for r in results)
    assert statuses == [400, 400, 503], [str(r) for r in results]  # two ran past the limit, one never started
    assert all("took longer than 0.05 s (--grammar-compile-timeout)" in str(r) for r in results if r.status == 400)
    assert all("compilers are busy" in str(r) for r in results if r.status == 503)


def test_slow_compiles_do_not_hold_up_a_plain_request(client):
    """Eight slow schemas in flight (two compile at a time on their own pool): a grammar-free request still gets
    its tokens before any of them answers. With compiles on the default pool (six threads), it queued behind them."""
    done: list[str] = []

    def slow(i: int) -> None:
        with contextlib.suppress(openai.APIError):  # timed out or busy: an answer all the same
            _complete(client, "hi", max_tokens=2, extra_body={"guided_json": _wide_schema(800, f"w{i}")})
        done.append(f"slow{i}")

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(slow, i) for i in range(8)]
        time.sleep(0.3)  # the eight are in
        assert _complete(client, "def main(", max_tokens=4).choices[0].finish_reason == "length"
        done.append("plain")
        for f in futures:
            f.result()
    assert done[0] == "plain", done
