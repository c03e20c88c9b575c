"""What the build refuses or marks before export (pool memory, tokenizer), and cleanup when it is killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder import cli, validate
from models.engine_format import load_engine_config
from plugins.kv_pool import KVPoolGeometry
from tests.builder.test_bad_checkpoint import _argv, refused

ROOT = Path(__file__).resolve().parents[2]


def test_pool_that_cannot_fit_the_machine_is_refused(checkpoint, tmp_path, capsys):
    """--max-batch 1000000 used to build (and the run then tried to allocate the pool: ~200 GB here)."""
    line = refused(capsys, checkpoint, tmp_path / "engine", r"the KV pool needs [\d.]+ GiB",
                   max_batch=1_000_000, max_num_tokens=3_000_000, max_seq_len=512)  # fmt: skip
    assert "this machine has" in line and "lower --max-batch to at most" in line, line


def test_keep_onnx_without_the_compiled_engine_is_refused(checkpoint, tmp_path, capsys):
    """--keep-onnx keeps the ONNX weights beside the compiled packages; an ONNX-only build keeps them anyway."""
    refused(capsys, checkpoint, tmp_path / "engine", r"--keep-onnx keeps .* \(--compile none\).* drop --keep-onnx",
            "--keep-onnx")  # fmt: skip


def test_memory_estimate_is_the_pool_plus_weights():
    geom = KVPoolGeometry(num_planes=3, num_blocks=101, block_size=4, num_kv_heads=2, head_dim=8)
    est = validate.memory_estimate(geom, weight_bytes=1000, blocks_per_request=25)
    assert est.pool_bytes == 3 * 2 * 101 * 4 * 2 * 8 * 4 == geom.nbytes
    assert est.total_bytes == est.pool_bytes + 1000
    assert est.bytes_per_request == 3 * 2 * 25 * 4 * 2 * 8 * 4
    with pytest.raises(validate.BuildError, match=r"the KV pool needs .* lower --max-batch to at most 3 "):
        validate.check_memory(est, available=1000 + 4 * est.bytes_per_request - 1, max_batch=4)
    validate.check_memory(est, available=est.total_bytes, max_batch=4)


def test_machine_memory_is_known():
    assert validate.machine_memory() > 1 << 28


def test_missing_tokenizer_builds_an_ids_only_engine(checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer_config.json").write_text("{}")  # config without tokenizer.json: still nothing loadable
    out = tmp_path / "engine"
    assert cli.main(_argv(ckpt, out)) == 0
    stdout = capsys.readouterr().out
    assert "ids-only" in stdout and "no tokenizer.json" in stdout, stdout
    cfg = load_engine_config(out)
    assert cfg.build["tokenizer"] == "ids-only" and "tokenizer.json" not in cfg.tokenizer_files
    assert json.loads((out / "config.json").read_text())["build"]["tokenizer"] == "ids-only"


def _start_build(ckpt: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "builder.cli", *_argv(ckpt, out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for_export(out: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any((tmp / "rank0").is_dir() for tmp in out.parent.glob(f".{out.name}.tmp-*")):
            return
        if proc.poll() is not None:
            pytest.fail(f"the build ended before export started: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("export did not start")


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_during_build_leaves_nothing(checkpoint, tmp_path, sig, rc):
    out = tmp_path / "engine"
    proc = _start_build(checkpoint, out)
    _wait_for_export(out, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == rc, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"build interrupted by {sig.name}" in err
    assert list(tmp_path.iterdir()) == [], "the temporary build directory must be removed"


def test_a_signal_whose_exception_a_library_wrapped_still_ends_the_build_as_a_signal(monkeypatch, capsys, tmp_path):
    """A library that catches BaseException and raises its own error (reported as a BuildError) must not turn
    SIGTERM into "build failed" (exit 2; seen once in CI under load): the signal received decides."""
    from builder import signals
    from builder.options import BuildError

    def run(args, err) -> int:
        with signals.raising():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except BaseException as e:  # noqa: BLE001 - the wrapping library
                raise BuildError(f"ONNX export of graph 'main' failed: RuntimeError: {e}") from None
        return 0

    monkeypatch.setattr(cli, "_run", run)
    assert cli.main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "e")]) == 143
    assert "build interrupted by SIGTERM" in capsys.readouterr().err


def test_signal_during_rebuild_keeps_the_old_engine(checkpoint, engine, tmp_path):
    out = tmp_path / "engine"
    shutil.copytree(engine, out)
    proc = _start_build(checkpoint, out)
    _wait_for_export(out, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    load_engine_config(out)  # the previous engine is intact
