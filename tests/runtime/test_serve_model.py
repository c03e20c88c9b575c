"""The Triton model's rules outside the stub: policy helpers, and model.py's cancellation path run against a real
engine (only the response sender is a stand-in: a real Triton cannot be made to fail is_cancelled())."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.serving.engine_loop import EngineLoop
from runtime.serving.limits import prompt_byte_limit, prompt_size_error
from runtime.serving.process import tritonserver_dir
from runtime.serving.triton_model.policy import Control, cancelled, encode
from runtime.serving.triton_server import TEMPLATE_DIR, main
from tests.runtime.serve_helpers import TINY


def _load_model_module(path=TEMPLATE_DIR / "model.py"):
    """model.py as the stub loads it; triton_python_backend_utils is the wheel's pure-Python part."""
    sys.path.insert(0, str(tritonserver_dir() / "backends" / "python"))
    spec = importlib.util.spec_from_file_location("mtp_triton_model_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BrokenSender:
    """A response sender whose request is gone: is_cancelled() raises, send() is recorded."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def is_cancelled(self) -> bool:
        raise RuntimeError("the request was released")

    def send(self, response=None, flags=0) -> None:
        self.sent.append(flags)


def test_is_cancelled_failure_aborts_the_request():
    """model.py's sink on the shared engine loop: a sender whose is_cancelled() raises is aborted, gets one FINAL."""
    mod = _load_model_module()
    engine = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=2)
    loop = EngineLoop(engine, max_queue=4)
    sender = BrokenSender()
    loop.start()
    loop.submit("def main(", SamplingParams(max_tokens=8), mod.TritonSink(sender, True, (), 2).sink)
    try:
        assert loop.wait_idle(60), "a sender whose is_cancelled() fails was kept running"
    finally:
        assert loop.stop()
    assert loop.counts.by_outcome["cancelled"] == 1 and loop.counts.by_outcome["finished"] == 0
    assert not engine.has_unfinished() and engine.kv.num_used_blocks == 0
    assert sender.sent == [mod.FINAL], "the stream must still get its one FINAL"


def test_cancelled_policy():
    class Ok:
        def __init__(self, value: bool) -> None:
            self.value = value

        def is_cancelled(self) -> bool:
            return self.value

    assert cancelled(Ok(False)) == (False, None) and cancelled(Ok(True)) == (True, None)
    flag, why = cancelled(BrokenSender())
    assert flag and why is not None and "RuntimeError" in why


def test_prompt_byte_cap():
    assert prompt_byte_limit(512) == 4096 and prompt_byte_limit(512, 100) == 100
    assert prompt_size_error(4096, 4096) is None
    msg = prompt_size_error(10_000_000, 4096)
    assert msg is not None and "10000000 bytes" in msg and "--max-prompt-bytes" in msg


def test_encode_matches_the_engine_tokenizer():
    engine = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=2)
    text = "def main(x):\n    return x + 1\n"
    assert encode(engine.tokenizer, text) == list(engine.tokenizer.encode(text).ids)


@pytest.mark.parametrize(("content", "expected"), [(None, None), ('{"timeout_s": 2.5}', 2.5), ("garbage", 0.0)])
def test_control_drain_file(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "drain").write_text(content)
    control = Control(tmp_path)
    assert control.drain_timeout() == expected
    control.report_drained()
    assert (tmp_path / "drained").exists()
    assert Control(None).drain_timeout() is None
    json.dumps(expected)


@pytest.mark.parametrize(("args", "needle"), [
    (["--max-prompt-bytes", "0", "--generate-only"], "--max-prompt-bytes 0: must be >= 1"),
    (["--drain-timeout", "-1"], "--drain-timeout -1: must be >= 0"),
    (["--frontend", "openai", "--num-state-snapshots", "-1"], "num_state_snapshots=-1: must be >= 0"),
    (["--frontend", "openai", "--state-snapshot-interval", "24"], "state_snapshot_interval=24: must be a multiple"),
])  # fmt: skip
def test_bad_serve_options_are_one_line_errors(tmp_path, capsys, args, needle):
    assert main(["--checkpoint", str(TINY), "--model-repo", str(tmp_path / "repo"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "nope"), "--model-repo", str(tmp_path / "repo"), "--generate-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a directory" in err and len(err.splitlines()) == 1
