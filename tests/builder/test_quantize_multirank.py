"""`mtp-build --quantize int8` for more than one rank (issue 26: "EP under mpirun" for every format).

A TP2 engine of models/tiny (EP2, the default with two ranks) with every dense linear int8: each rank quantizes its
own shard while it is loaded (a row-parallel shard's per-output-channel scale is over its own slice of the input
features, so the ranks' int8 weights are not slices of the single-rank engine's: correctness is each rank's
packages against that rank's torch shard quantized the same way, which `--check` probes under mpirun). The routed
experts are int8 too: each rank stores its own column's experts (quantize_int8 per expert row: exactly those experts'
rows of the single-rank engine) and computes them with mtp::moe_experts_int8 inside their exchange op,
mtp::moe_experts_int8_exchange (plugins/moe_ep.py). Under mpirun, K=2 with 2-token prefill chunks and a repeated prompt (a prefix hit) is token-identical to K=0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from builder import cli
from models.engine_format import load_engine_config
from tests.mpi_launch import mpirun_path
from tests.runtime.test_mpi_lockstep import ENV, ROOT

TINY = ROOT / "models" / "tiny"
MTP_RUN = Path(sys.executable).parent / "mtp-run"
pytestmark = [pytest.mark.skipif(mpirun_path() is None, reason="mpirun not installed"), pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def tp2_int8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2_int8") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--compile", "aoti", "--quantize", "int8",
            "--world-size", "2", "--tp-size", "2", "--num-draft-tokens", "2", "--max-seq-len", "128", "--max-batch", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    return out


def test_each_rank_stores_its_shard_int8_and_check_probes_it(tp2_int8, capsys):
    """Every graph of both ranks quantized (recorded), and `--check` runs each rank's packages under mpirun against
    that rank's shard with the recorded weights quantized as built (the unquantized shard would miss by ~1e-2)."""
    compiled = load_engine_config(tp2_int8).build["compiled"]
    assert compiled["quantized_graphs"] == ["main", "mtp_draft", "mtp_commit"]
    assert compiled["int8"]["ops"] == ["linear_int8", "moe_experts_int8_exchange"]
    model = load_engine_config(tp2_int8).model
    # experts nodes: main, one per MoE layer; draft, the MTP layer's; commit, none
    moe_layers = model.num_hidden_layers - model.first_k_dense_replace
    assert [compiled["graphs"][g]["int8_experts"] for g in compiled["quantized_graphs"]] == [moe_layers, 1, 0]
    assert {"layers.1.mlp.w_gate_up", "layers.1.mlp.w_down"} <= set(compiled["int8"]["weights"])
    capsys.readouterr()
    assert cli.main(["--check", str(tp2_int8)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "compiled packages of 2 ranks match the torch model (each rank's shard, under mpirun)" in out, out


PROMPT = "def main(argv):\n    import os\n    return os.path.join(argv[0], argv[1])"


def _run(engine: Path, k: int) -> tuple[list[list[int]], dict]:
    """(output ids per prompt, summary) of `mpirun -np 2 mtp-run` one request at a time: the second prompt hits the
    first's cached blocks."""
    prompts = [PROMPT, PROMPT, "class A:"]
    argv = [mpirun_path() or "mpirun", "-np", "2", "--oversubscribe", str(MTP_RUN), "--engine", str(engine),
            *[a for p in prompts for a in ("--prompt", p)], "--max-tokens", "16", "--json", "--num-draft-tokens",
            str(k), "--prefill-chunk", "2", "--max-batch", "1", "--acceptance-check", "off"]  # fmt: skip
    proc = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [r["output_ids"] for r in records if "output_ids" in r], records[-1]["summary"]


def test_mtp_on_the_int8_tp2_engine_is_lossless_under_mpirun(tp2_int8):
    k0, summary = _run(tp2_int8, 0)
    assert len(k0) == 3 and all(len(ids) == 16 for ids in k0)
    k2, summary2 = _run(tp2_int8, 2)
    assert k2 == k0
    assert summary["executor"] == summary2["executor"] == "compiled"
    assert summary2["prefix_cache_hit_tokens"] > 0 and summary2["mean_acceptance_length"] > 1
