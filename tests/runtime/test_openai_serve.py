"""The OpenAI frontend, driven by the real `openai` client against a real `mtp-serve --frontend openai`
subprocess on loopback (models/tiny, torch executor, K=3, 1 thread)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.serving.openai.server import load_chat_template
from runtime.serving.process import children, pid_alive
from tests.runtime.openai_helpers import TINY, OpenAIServer, client_fixture, server_fixture

pytestmark = pytest.mark.timeout(120)
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def __init__(self"]
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 3


server = server_fixture("--num-draft-tokens", "3", "--per-request-spec-decode-metrics", "summary")
client = client_fixture(60)


@pytest.fixture(scope="module")
def local():
    """The in-process engine with the server's configuration: the reference greedy output."""
    return create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=3)


def _reference(engine, prompt: str, max_tokens: int):
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == ["tiny"]
    status, body = server.health()
    assert status == 200 and json.loads(body)["status"] == "ready"


def test_completions_match_in_process_engine(client, local):
    for prompt in PROMPTS:
        ref = _reference(local, prompt, 24)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        u = r.usage
        assert u.prompt_tokens == len(local.tokenizer.encode(prompt).ids)
        assert u.completion_tokens == len(ref.output_ids) and u.total_tokens == u.prompt_tokens + u.completion_tokens
        spec = r.model_extra["metrics"]["speculative_decoding"]  # vLLM #48915's shape (opted in by the flag)
        assert spec["num_spec_tokens"] == 3 and spec["num_draft_tokens"] == 3 * spec["num_spec_steps"]
        assert spec["num_spec_steps"] == len(ref.accepted_per_step)
        assert spec["num_accepted_draft_tokens"] == sum(ref.accepted_per_step)
        assert spec["acceptance_histogram"] == [ref.accepted_per_step.count(j) for j in range(4)]
        assert spec["mean_acceptance_length"] == pytest.approx(1 + sum(ref.accepted_per_step) / spec["num_spec_steps"])

        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(ref.output_ids)
        assert chunks[-1].usage.prompt_tokens == u.prompt_tokens


def test_sse_wire_format_ends_in_done(server):
    body = {"prompt": "def main(", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and "[DONE]" not in "".join(events[:-1])


def test_cached_tokens_on_repeated_long_prompt(client):
    first = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 32  # more than two 16-token blocks: full blocks are published
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text


def test_chat_completions(client, local):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = load_chat_template(TINY).render(messages=messages, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    ref = _reference(local, rendered, 16)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n=17"),
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": "x " * 2000}, "max_seq_len"),
    ({"prompt": [10**9]}, "outside the vocabulary"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])  # fmt: skip
def test_bad_requests_get_400_with_a_message(client, kwargs, needle):
    args = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400 and needle in e.value.message


def test_malformed_bodies_are_4xx_never_500(server):
    url = server.url + "/v1/completions"
    for data, code in ((b"{not json", 400), (b"[]", 400), (b'{"prompt": 5}', 400),
                       (b'{"prompt": "x", "max_tokens": true}', 400), (b"x" * 300_000, 413)):  # fmt: skip
        r = httpx.post(url, content=data, timeout=30)
        assert r.status_code == code, (data[:40], r.text)
        assert r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nope", timeout=10).status_code == 404


def test_32_concurrent_streams_all_finish(client):
    def one(i: int) -> tuple[str | None, int]:
        stream = client.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        return [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(reason in ("length", "stop") and n > 0 for reason, n in results)


def _wait_idle(server, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if (m["mtp_kv_blocks_used"] == 0 and m["mtp_requests_running"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_the_request(server, local):
    assert len(_reference(local, PROMPTS[0], 400).output_ids) == 400  # left alone, it runs all 400 tokens
    base = _wait_idle(server)
    assert base["mtp_kv_blocks_used"] == 0
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metrics()["mtp_kv_blocks_used"] > 0  # the request holds blocks while it streams
    # closed after the first chunk: the server aborts it long before 400 tokens
    m = _wait_idle(server)
    assert m["mtp_kv_blocks_used"] == 0 and m["mtp_requests_running"] == 0
    assert m.get('mtp_requests_total{outcome="cancelled"}', 0) >= 1
    # engine side: the aborted request stopped generating (the client-side counter stops at the disconnect anyway)
    assert m["mtp_engine_generated_tokens_total"] - base["mtp_engine_generated_tokens_total"] < 300


def test_queue_full_is_429():
    srv = OpenAIServer("--num-draft-tokens", "0", "--max-queue", "1")
    try:
        body = {"prompt": "def main(", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the response (a disconnect)
            assert next(lines).startswith("data: ")
            second = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            assert second.status_code == 429 and "--max-queue" in second.json()["error"]["message"]
        # SIGTERM while idle again: drains, exits 0, leaves no child running
        rc = srv.stop()
        assert rc == 0
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_sigterm_drains_in_flight_stream_and_exits_0():
    srv = OpenAIServer("--num-draft-tokens", "3", "--drain-timeout", "30")
    got: dict = {}

    def stream() -> None:
        body = {"prompt": "def main(", "max_tokens": 120, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            got["lines"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while srv.metrics().get("mtp_generation_tokens_total", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = srv.proc.pid
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    t.join(30)
    assert got["lines"][-1] == "data: [DONE]"  # the in-flight stream ran to its end
    out = srv.proc.stdout.read()
    assert "stopped (drained)" in out, out
    assert not pid_alive(pid) and not children(pid)
