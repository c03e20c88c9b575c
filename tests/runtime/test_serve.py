"""mtp-serve end to end: the REAL tritonserver (nvidia-pytriton's 2.51 binary) serving models/tiny over gRPC.

One server for the module, on free loopback ports, torch executor, K=2. If it cannot start, the tests FAIL
with the server log tail. Teardown always stops it (SIGTERM, then SIGKILL) and removes the shared-memory
regions it created (their prefix is unique to this server).
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.serving.triton_server import MODEL_NAME, ServeError, TritonServer, free_ports, main, write_model_repo
from tests.runtime import serve_helpers as h
from tests.runtime.serve_helpers import TINY
from tests.runtime.serve_helpers import ids_of as _ids
from tests.runtime.serve_helpers import text_of as _text

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

K = 2
PROMPTS = ["def main(", "import numpy as np\n", "class Foo:\n    def __init__(self", "for i in range("]
MAX_TOKENS = 24
START_TIMEOUT_S = 60
RESPONSE_TIMEOUT_S = h.RESPONSE_TIMEOUT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = write_model_repo(tmp_path_factory.mktemp("model_repo"), checkpoint=TINY, executor="torch",
                            num_draft_tokens=K, threads=1)  # fmt: skip
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(repo, http, grpc, metrics, log_path=tmp_path_factory.mktemp("log") / "tritonserver.log")
    try:
        srv.start()
        try:
            srv.wait_ready(START_TIMEOUT_S)
        except ServeError as e:
            pytest.fail(f"tritonserver did not start: {e}", pytrace=False)
        yield srv
    finally:
        rc = srv.stop()
        leftovers = srv.leftover_shm()
    assert not leftovers, f"shared-memory regions left behind: {leftovers}"
    assert rc == 0, f"tritonserver exit code {rc} after SIGTERM; log:\n{srv.log_tail()}"
    assert not h.leftovers(srv), f"left behind: {h.leftovers(srv)}"


@pytest.fixture(scope="module")
def reference():
    """The engine's own greedy outputs, in process, one prompt at a time."""
    engine = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=K)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return {p: engine.generate([p], params)[0] for p in PROMPTS}


def generate(srv: TritonServer, prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = True, **extra):
    return h.generate(srv.grpc_port, prompt, max_tokens, stream, **extra)


def test_generate_only_writes_a_decoupled_python_model(tmp_path):
    assert main(["--checkpoint", str(TINY), "--num-draft-tokens", "2", "--model-repo", str(tmp_path),
                 "--state-snapshot-interval", "32", "--generate-only"]) == 0  # fmt: skip
    config = (tmp_path / MODEL_NAME / "config.pbtxt").read_text()
    assert 'key: "state_snapshot_interval" value: { string_value: "32" }' in config
    assert 'backend: "python"' in config and "decoupled: true" in config
    assert f'value: {{ string_value: "{TINY}" }}' in config and 'string_value: "auto"' in config  # resolved at load
    assert (tmp_path / MODEL_NAME / "1" / "model.py").is_file()


def test_greedy_stream_matches_the_engine(server, reference):
    responses, error = generate(server, PROMPTS[0])
    assert error is None, f"{error}\n{server.log_tail()}"
    ref = reference[PROMPTS[0]]
    assert len([r for r in responses if len(r.as_numpy("output_ids"))]) >= 3, "expected several streamed chunks"
    assert _ids(responses) == ref.output_ids
    assert _text(responses) == ref.text
    assert responses[-1].as_numpy("finish_reason")[0].decode() == ref.finish_reason


def test_speculative_stats(server, reference):
    responses, error = generate(server, PROMPTS[1], stream=False)
    assert error is None, error
    assert len(responses) == 1, "stream=False sends one response with the whole text"
    final, ref = responses[-1], reference[PROMPTS[1]]
    assert [int(t) for t in final.as_numpy("output_ids")] == ref.output_ids
    assert final.as_numpy("text_output")[0].decode() == ref.text
    accepted = int(final.as_numpy("total_accepted_draft_tokens")[0])
    drafted = int(final.as_numpy("total_draft_tokens")[0])
    assert 0 <= accepted <= drafted and drafted > 0
    assert accepted == sum(ref.accepted_per_step) and drafted == K * ref.num_steps
    assert final.as_numpy("acceptance_rate")[0] == pytest.approx(accepted / drafted)
    per_position = final.as_numpy("acceptance_per_position")
    assert per_position.shape == (K,) and all(0.0 <= x <= 1.0 for x in per_position)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for i in range(K):
        assert f'mtp_draft_tokens_proposed_total{{model="{MODEL_NAME}",position="{i}"}}' in metrics
        assert f'mtp_draft_tokens_accepted_total{{model="{MODEL_NAME}",position="{i}"}}' in metrics


def test_four_concurrent_streams(server, reference):
    results: dict[str, tuple] = {}

    def run(prompt):
        results[prompt] = generate(server, prompt)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * RESPONSE_TIMEOUT_S)
    assert sorted(results) == sorted(PROMPTS)
    for prompt, (responses, error) in results.items():
        assert error is None, f"{prompt!r}: {error}"
        assert _ids(responses) == reference[prompt].output_ids, prompt
        assert _text(responses) == reference[prompt].text, prompt


def test_bad_request_fails_alone(server, reference):
    results: dict[str, tuple] = {}
    jobs = {
        "good": lambda: generate(server, PROMPTS[2]),
        "zero_max_tokens": lambda: generate(server, PROMPTS[3], max_tokens=0),
        "empty_text": lambda: generate(server, "", max_tokens=4),
        "bad_top_p": lambda: generate(server, PROMPTS[3], max_tokens=4, temperature=1.0, top_p=1.5),
    }
    threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f())) for n, f in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * RESPONSE_TIMEOUT_S)
    responses, error = results["good"]
    assert error is None, error
    assert _ids(responses) == reference[PROMPTS[2]].output_ids
    for name, needle in (("zero_max_tokens", "max_tokens"), ("empty_text", "empty prompt"), ("bad_top_p", "top_p")):
        responses, error = results[name]
        assert error is not None and needle in error, f"{name}: {error!r}"
        assert not _ids(responses), name
    # the server keeps serving after the errors
    responses, error = generate(server, PROMPTS[0], max_tokens=4)
    assert error is None and _ids(responses) == reference[PROMPTS[0]].output_ids[:4]


def test_huge_prompt_is_refused_before_tokenizing_and_does_not_stall_streams(server):
    """A 10 MB prompt used to be tokenized on the engine loop (~15 s here) before the length check, stalling
    every stream. Now its size is checked on the raw bytes first, and tokenizing happens off the loop."""
    gaps: list[float] = []
    last = [0.0]
    started, big_sent = threading.Event(), threading.Event()

    def on_response(_r) -> None:
        now = time.monotonic()
        if big_sent.is_set():
            gaps.append(now - last[0])
        last[0] = now
        started.set()

    result: dict[str, tuple] = {}
    stream = threading.Thread(target=lambda: result.__setitem__(
        "s", h.generate(server.grpc_port, "x = 1\n" * 20, 400, temperature=1.0, seed=1, on_response=on_response)))
    stream.start()
    assert started.wait(RESPONSE_TIMEOUT_S)
    big_sent.set()
    t0 = time.monotonic()
    responses, error = generate(server, "def f():\n    return 1\n" * (10_000_000 // 23), max_tokens=4)
    refused_s = time.monotonic() - t0
    stream.join(2 * RESPONSE_TIMEOUT_S)
    assert error is not None and "max_prompt_bytes" in error and "bytes" in error, error
    assert not responses
    assert refused_s < 10, f"refusing the 10 MB prompt took {refused_s:.1f} s"
    assert result["s"][1] is None, result["s"][1]
    # Tokenizing it on the loop stalled streams ~15 s on a quiet machine (longer loaded); 6 s is far below that and
    # far above what a loaded 2-core machine's scheduling adds (2.5 s seen at load 8, which 2.0 here used to fail).
    assert gaps and max(gaps) < 6.0, f"a running stream stalled {max(gaps):.1f} s while the big prompt arrived"
