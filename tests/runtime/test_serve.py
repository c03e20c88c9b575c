"""mtp-serve end to end: the REAL tritonserver (nvidia-pytriton's 2.51 binary) serving models/tiny over gRPC.

One server for the module, on free loopback ports, torch executor, K=2. If it cannot start, the tests FAIL
with the server log tail. Teardown always stops it (SIGTERM, then SIGKILL) and removes the shared-memory
regions it created (their prefix is unique to this server).
"""

from __future__ import annotations

import queue
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from runtime.factory import create_engine
from runtime.sampling import SamplingParams
from runtime.serving.triton_server import MODEL_NAME, ServeError, TritonServer, free_ports, main, write_model_repo

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
K = 2
PROMPTS = ["def main(", "import numpy as np\n", "class Foo:\n    def __init__(self", "for i in range("]
MAX_TOKENS = 24
START_TIMEOUT_S = 60
RESPONSE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = write_model_repo(tmp_path_factory.mktemp("model_repo"), checkpoint=TINY, executor="torch",
                            num_draft_tokens=K, torch_threads=1)  # fmt: skip
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


@pytest.fixture(scope="module")
def reference():
    """The engine's own greedy outputs, in process, one prompt at a time."""
    engine = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=K)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return {p: engine.generate([p], params)[0] for p in PROMPTS}


def _input(name: str, value, dtype: str):
    arr = np.array(value if isinstance(value, list) else [value])
    if dtype == "BYTES":
        arr = np.array([v.encode() if isinstance(v, str) else v for v in arr.tolist()], dtype=np.object_)
    else:
        arr = arr.astype({"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}[dtype])
    tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
    tensor.set_data_from_numpy(arr)
    return tensor


def generate(srv: TritonServer, prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = True, **extra):
    """One request on its own gRPC stream; returns (responses, error message or None)."""
    inputs = [_input("text_input", prompt, "BYTES"), _input("max_tokens", max_tokens, "INT32"),
              _input("stream", stream, "BOOL")]  # fmt: skip
    types = {"temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "seed": "INT64", "end_id": "INT32",
             "stop_words": "BYTES"}  # fmt: skip
    inputs += [_input(name, value, types[name]) for name, value in extra.items()]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    responses, error = [], None
    try:
        client.async_stream_infer(MODEL_NAME, inputs, enable_empty_final_response=True)
        while True:
            result, err = results.get(timeout=RESPONSE_TIMEOUT_S)
            if err is not None:
                error = str(err)
                break
            responses.append(result)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, error


def _ids(responses) -> list[int]:
    return [int(t) for r in responses if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids")]


def _text(responses) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in responses if r.as_numpy("text_output") is not None)


def test_generate_only_writes_a_decoupled_python_model(tmp_path):
    assert main(["--checkpoint", str(TINY), "--num-draft-tokens", "2", "--model-repo", str(tmp_path),
                 "--generate-only"]) == 0  # fmt: skip
    config = (tmp_path / MODEL_NAME / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config
    assert f'value: {{ string_value: "{TINY}" }}' in config and 'string_value: "torch"' in config
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
        "bad_top_p": lambda: generate(server, PROMPTS[3], max_tokens=4, temperature=1.0, top_p=0.0),
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
