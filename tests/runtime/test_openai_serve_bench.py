"""mtp-bench serve (runtime/bench/serve_bench.py): the statistics, and one short real run over both the OpenAI
server and the in-process baseline (models/tiny, torch, 1 thread)."""

from __future__ import annotations

import json

import pytest

from runtime.bench.runners import heldout_files
from runtime.bench.serve_bench import RequestResult, main, prompt_set
from runtime.bench.serve_report import summarize
from tests.runtime.openai_helpers import TINY

pytestmark = pytest.mark.timeout(180)


def test_summarize_percentiles_and_throughput():
    ok = [RequestResult(True, ttft=0.1 * i, latency=0.1 * i + 0.9, itls=[0.01 * i], num_output=10) for i in (1, 2, 3)]
    s = summarize([*ok, RequestResult(False, error="HTTP 400: x")], wall=2.0)
    assert s["completed"] == 3 and s["num_requests"] == 4 and s["errors"] == ["HTTP 400: x"]
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p99"] == pytest.approx(29.8) and s["output_throughput"] == pytest.approx(15.0)
    assert s["request_throughput"] == pytest.approx(1.5)


def test_prompt_set_is_fixed_and_varied():
    a, b = prompt_set(TINY, 6), prompt_set(TINY, 6)
    assert a == b and len({len(p) for p in a}) >= 3
    pool = len(heldout_files(TINY, None)[0])
    more = prompt_set(TINY, 2 * pool)  # 32 streams need more prompts than there are held-out files: they cycle
    assert len(set(more)) == 2 * pool and more[0] != more[pool] and more[pool][:40] == more[0][:40]


def test_short_real_run_writes_json_table_and_plot(tmp_path):
    rc = main(["--checkpoint", str(TINY), "--executor", "torch", "--frontend", "openai,inprocess",
               "--num-draft-tokens", "2", "--rates", "8", "--max-concurrency", "2", "--num-prompts", "3",
               "--max-tokens", "8", "--output-dir", str(tmp_path)])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "serve_bench.json").read_text())
    assert [(e["frontend"], e["num_draft_tokens"]) for e in data["results"]] == [("openai", "2"), ("inprocess", "2")]
    for e in data["results"]:
        assert [r["mode"] for r in e["runs"]] == ["poisson", "concurrency"]
        assert all(r["completed"] == 3 and r["total_output_tokens"] == 24 for r in e["runs"])
    assert "| openai K=2 | Poisson 8/s |" in (tmp_path / "serve_table.md").read_text()
    assert (tmp_path / "serve_latency_vs_rate.png").stat().st_size > 0
