"""The OpenAI frontend's engine loop and request schema, in process with the real engine (models/tiny, torch)."""

from __future__ import annotations

import asyncio

import pytest

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.serving.openai import protocol as P
from runtime.serving.openai.engine_loop import AsyncEngineLoop as EngineLoop
from runtime.serving.openai.engine_loop import NotServing, QueueFull
from runtime.serving.stream_text import stable_text as _stable_text
from tests.runtime.openai_helpers import TINY

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    return create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=2)


def _ids(engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text).ids)


async def _collect(queue: asyncio.Queue) -> list:
    events = []
    while not events or not events[-1].finished:
        events.append(await asyncio.wait_for(queue.get(), 60))
    return events


def test_batches_requests_and_matches_generate(engine):
    prompts = ["def main(", "import os\n", "class A:\n"]
    ref = [o.output_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12))]
    loop = EngineLoop(engine, max_queue=8)
    loop.start()

    async def go():
        subs = [loop.submit(_ids(engine, p), SamplingParams(max_tokens=12)) for p in prompts]
        return await asyncio.gather(*(_collect(q) for _, q in subs))

    try:
        results = asyncio.run(go())
    finally:
        assert loop.drain(5.0)
    assert [[t for ev in evs for t in ev.new_token_ids] for evs in results] == ref
    assert all(evs[-1].finish_reason == "length" and not evs[-1].error for evs in results)
    assert engine.kv.num_used_blocks == 0 and not [r for r in engine.requests if r.startswith("oai-")]  # forgotten


def test_admission_control_and_drain(engine):
    loop = EngineLoop(engine, max_queue=1)
    loop.start()

    async def go():
        _, q = loop.submit(_ids(engine, "def main("), SamplingParams(max_tokens=400))
        with pytest.raises(QueueFull, match="max-queue"):
            loop.submit([1, 2], SamplingParams(max_tokens=2))
        first = await asyncio.wait_for(q.get(), 60)
        assert first.new_token_ids and engine.kv.num_used_blocks > 0
        clean = await asyncio.to_thread(loop.drain, 0.0)  # no grace: the stream is cut short
        return clean, await _collect(q)

    clean, events = asyncio.run(go())
    assert not clean and "shutting down" in (events[-1].error or "")
    assert engine.kv.num_used_blocks == 0 and not loop.ready and loop.num_in_flight == 0

    async def after():
        with pytest.raises(NotServing):
            loop.submit([1], SamplingParams(max_tokens=1))

    asyncio.run(after())


def test_abort_frees_blocks_even_before_admission(engine):
    loop = EngineLoop(engine, max_queue=4)
    loop.start()

    async def go():
        rid, q = loop.submit(_ids(engine, "def main("), SamplingParams(max_tokens=400))
        loop.abort(rid)  # may arrive in the same batch as the submit: admitted first, then aborted
        rid2, q2 = loop.submit(_ids(engine, "import os\n"), SamplingParams(max_tokens=400))
        await asyncio.wait_for(q2.get(), 60)
        loop.abort(rid2)
        for _ in range(200):
            if loop.num_in_flight == 0:
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(go())
        assert loop.num_in_flight == 0
    finally:
        assert loop.drain(5.0)
    assert engine.kv.num_used_blocks == 0 and not engine.scheduler.has_work()


def test_bad_request_at_admission_is_an_error_event(engine):
    loop = EngineLoop(engine, max_queue=4)
    loop.start()

    async def go():
        _, q = loop.submit([engine.model_cfg.vocab_size + 5], SamplingParams(max_tokens=2))
        return await _collect(q)

    try:
        events = asyncio.run(go())
    finally:
        loop.drain(5.0)
    assert events[-1].bad_request and "vocabulary" in events[-1].error


def test_protocol_refuses_unknown_fields_by_name_and_strict_types():
    with pytest.raises(P.ProtocolError, match="'frequency_penalty' is not supported"):
        P.parse(P.CompletionRequest, b'{"prompt": "x", "frequency_penalty": 2}')
    # issue 31 item 9: LangChain's function calling sends parallel_tool_calls first; the refusal names `tools`
    body = b'{"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": false, "tools": [{"type": "function"}]}'
    with pytest.raises(P.ProtocolError, match=r"'tools' is not supported by this server \(no tool calling\)"):
        P.parse(P.ChatCompletionRequest, body)
    with pytest.raises(P.ProtocolError, match="max_tokens"):
        P.parse(P.CompletionRequest, b'{"prompt": "x", "max_tokens": "3"}')
    req = P.parse(P.CompletionRequest, b'{"prompt": "x", "stop": "\\n", "temperature": 0, "presence_penalty": null}')
    params = P.sampling_params(req, 16)
    assert params.stop == ("\n",) and params.temperature == 0 and params.max_tokens == 16


def test_stable_text_holds_back_a_possible_stop_prefix():
    assert _stable_text("abc\n", ("\n\n",)) == "abc"
    assert _stable_text("abc\ufffd", ()) == "abc"
    assert _stable_text("abcEN", ("END",)) == "abc" and _stable_text("abcE!", ("END",)) == "abcE!"
