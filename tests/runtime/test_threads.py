"""`--threads` (plugins/threads.py default_threads): one rule for every CLI. Default: OMP_NUM_THREADS when set, else the cores this
process may use (its affinity mask, what `taskset` or a container limits); the count reaches torch and the run's
summary; a count below 1 is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder import cli as build_cli
from plugins.threads import default_threads
from runtime import cli as run_cli

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"


def test_the_default_is_omp_num_threads_else_the_affinity_mask(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == len(os.sched_getaffinity(0))


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset not installed")
def test_a_process_limited_to_one_core_defaults_to_one_thread():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    code = "from plugins.threads import default_threads; print(default_threads())"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "1"


def test_mtp_run_uses_and_reports_the_count_and_refuses_zero(capsys):
    before = torch.get_num_threads()
    try:
        argv = ["--checkpoint", str(TINY), "--prompt", "def main(", "--max-tokens", "4", "--json",
                "--acceptance-check", "off"]  # fmt: skip
        assert run_cli.main([*argv, "--threads", "1"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
        assert summary["threads"] == 1 and torch.get_num_threads() == 1
        assert run_cli.main([*argv, "--threads", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["mtp-run: error: --threads 0: must be >= 1 (default: OMP_NUM_THREADS, else the cores this "
                       "process may use)"], err  # fmt: skip
    finally:
        torch.set_num_threads(before)


def test_mtp_build_sets_the_count_for_itself_and_its_ranks_and_refuses_zero(tmp_path, monkeypatch, capsys):
    """mtp-build --threads N: torch's count in the build and OMP_NUM_THREADS for the rank processes it starts."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert build_cli.main(["--checkpoint", str(TINY), "--output", str(tmp_path / "e"), "--threads", "0"]) == 2
        assert "--threads 0: must be >= 1" in capsys.readouterr().err and torch.get_num_threads() == before
        torch.set_num_threads(1)
        assert build_cli.main(["--check", str(tmp_path / "missing"), "--threads", "2"]) == 2  # no engine there
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)
