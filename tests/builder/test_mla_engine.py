"""DeepSeek-V3 / GLM-4.7-Flash (MLA) checkpoints through the whole tool, exactly as GLM-4.5 goes:
`mtp-build` (+ `--check`) writes an engine with a latent pool, the ONNX Runtime engine equals the torch
executor (logits, hidden states, every KV plane) and `mtp-run` decodes it losslessly (expert parallelism under
a real `mpirun` gives the single-rank output: tests/runtime/test_mpi_lockstep.py, with the mpirun group). The
checkpoints are written by transformers itself (models/testing.py make_mla_checkpoint)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from builder import cli
from models.checkpoint import load_model
from models.engine_format import load_engine_config
from models.testing import MLA_VARIANTS, make_mla_checkpoint
from runtime.core.sampling import SamplingParams
from runtime.executors.ort_executor import OrtExecutor
from runtime.executors.torch_executor import TorchExecutor
from runtime.factory import create_engine
from tests.builder.conftest import LIMITS, write_tokenizer
from tests.builder.test_ort_executor import check_ort_matches_torch
from tests.runtime.engine_utils import random_prompts

VARIANTS = ("dsv3_yarn", "glm_lite")  # q_lora + YaRN + grouped routing; no q_lora, plain rope (GLM-4.7-Flash)


def _build(ckpt, out, *extra: str) -> None:
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none", *extra]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0


@pytest.fixture(scope="module", params=VARIANTS)
def mla(request, tmp_path_factory):
    model_type, overrides = MLA_VARIANTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    make_mla_checkpoint(root / "ckpt", model_type, seed=5, **overrides)
    write_tokenizer(root / "ckpt" / "tokenizer.json", 96)
    _build(root / "ckpt", root / "engine")
    return root / "ckpt", root / "engine"


def test_build_records_a_latent_pool_and_checks(mla):
    ckpt, engine = mla
    ecfg = load_engine_config(engine)
    m = ecfg.model
    assert (ecfg.kv.kv_kind, ecfg.kv.num_kv_heads, ecfg.kv.head_dim) == (1, 1, m.qk_rope_head_dim + m.kv_lora_rank)
    assert cli.main(["--check", str(engine)]) == 0


def test_ort_engine_equals_torch_executor(mla):
    ckpt, engine = mla
    model, _ = load_model(ckpt)
    check_ort_matches_torch(OrtExecutor(engine, num_blocks=40), TorchExecutor(model, num_blocks=40, block_size=4),
                            mtp_plane=model.cfg.num_hidden_layers)  # fmt: skip


def test_mtp_run_on_the_engine_is_lossless(mla):
    """mtp-run (ORT engine, K=2, --json) prints the same greedy tokens as the torch executor without MTP."""
    ckpt, engine = mla
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
    assert len(set(map(tuple, expected))) == 2
