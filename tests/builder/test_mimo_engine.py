"""MiMo (`MiMoForCausalLM`, hidden-first MTP over the pre-norm hidden) through the whole tool: `mtp-build` (+ `--check`)
writes an engine whose ONNX Runtime graphs equal the torch executor (logits, hidden states, every KV plane), and
`mtp-run` on it decodes losslessly. Hybrid (Gated DeltaNet) checkpoints are refused by `mtp-build` with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from builder import cli
from models.checkpoint import load_model
from models.testing import make_hybrid_checkpoint, make_mimo_checkpoint
from runtime.core.sampling import SamplingParams
from runtime.executors.ort_executor import OrtExecutor
from runtime.executors.torch_executor import TorchExecutor
from runtime.factory import create_engine
from tests.builder.conftest import LIMITS, write_tokenizer
from tests.builder.test_ort_executor import check_ort_matches_torch
from tests.runtime.engine_utils import random_prompts


def _argv(ckpt, out) -> list[str]:
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none"]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo")
    make_mimo_checkpoint(root / "ckpt", seed=5)
    write_tokenizer(root / "ckpt" / "tokenizer.json", 96)
    assert cli.main(_argv(root / "ckpt", root / "engine")) == 0
    return root / "ckpt", root / "engine"


def test_build_checks_and_ort_engine_equals_torch_executor(mimo):
    ckpt, engine = mimo
    assert cli.main(["--check", str(engine)]) == 0
    model, _ = load_model(ckpt)
    check_ort_matches_torch(OrtExecutor(engine, num_blocks=40), TorchExecutor(model, num_blocks=40, block_size=4),
                            mtp_plane=model.cfg.num_hidden_layers)  # fmt: skip


def test_mtp_run_on_the_engine_is_lossless(mimo):
    """mtp-run (ORT engine, --json) prints the same greedy tokens as the torch executor without MTP."""
    ckpt, engine = mimo
    prompts = [" ".join(f"w{i}" for i in p) for p in random_prompts((7, 12), seed=3, vocab=96)]
    ref = create_engine(checkpoint=ckpt, executor="torch", num_draft_tokens=0, block_size=4, num_blocks=64,
                        max_batch=4, max_num_tokens=32, max_seq_len=64)  # fmt: skip
    expected = [o.output_ids for o in ref.generate(prompts, SamplingParams(max_tokens=12))]
    argv = [sys.executable, "-m", "runtime.cli", "--engine", str(engine), "--max-tokens", "12", "--json"]
    for p in prompts:
        argv += ["--prompt", p]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    got = {r["prompt"]: r["output_ids"] for r in records if "output_ids" in r}
    assert [got[p] for p in prompts] == expected


@pytest.mark.parametrize("flags", [["--tp-size", "4", "--world-size", "4", "--ep-size", "4"]])
def test_hybrid_tp_size_that_does_not_split_the_gdn_key_heads_is_refused_with_one_line(tmp_path, capsys, flags):
    """Hybrid engines build for ONNX Runtime and AOTInductor (tests/builder/test_hybrid_engine.py; tensor-parallel
    ones: tests/runtime/test_mpi_hybrid.py); a tp size that does not divide the GDN key heads (2) is refused before
    anything is exported."""
    make_hybrid_checkpoint(tmp_path / "ckpt", "qwen3_next", seed=1)
    assert cli.main(_argv(tmp_path / "ckpt", tmp_path / "engine") + flags) != 0
    err = capsys.readouterr().err
    assert "linear_num_key_heads=2 does not split over --tp-size 4" in err and "Traceback" not in err
    assert not (tmp_path / "engine").exists()
