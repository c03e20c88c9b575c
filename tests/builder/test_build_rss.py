"""A whole `mtp-build` of a sharded checkpoint stays within one rank's share in memory (issue: real-size import).

An 848 MiB bf16 checkpoint (4 MoE layers + MTP, 64 experts each) is built for EP4 in fp32 (the whole model is
1.7 GiB in fp32, one rank's share 0.53 GiB). Peak RSS of the build (the largest of its processes: the parent,
and the per-rank export children of builder/rank_process.py) must stay within the peak of a tiny build (python
+ torch + onnx + ORT baseline) + the largest tensor + one rank's share + slack. Before the per-rank children,
the exporter kept every exported rank's weights and this build peaked at 1,639 MiB (the bound is ~1,500).

Marked `scale` (`make test-scale`, run by CI after `make test`): it takes 2.5-3 min on the 2-core machine and cannot
be made cheap without losing its point. The regression it guards overshot the bound by only ~140 MiB at this size,
and that overshoot scales with the model (the ranks' shares the exporter kept), while the slack does not: a smaller
checkpoint would put the regression inside the slack and the test would pass on the broken exporter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.checkpoint import default_mapping, index_checkpoint, plan_weights, rank_weight_bytes
from tests.builder.conftest import write_tokenizer
from tests.models.test_streaming_import import BIG, write_sharded

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
CFG = dataclasses.replace(BIG, num_hidden_layers=4)  # the streaming-import test's model, 4 layers: 848 MiB
SLACK = 128 * MiB  # the exporter's and ORT's own working memory, allocator rounding

# Runs one mtp-build and prints the peak RSS of its largest process (it and the children it waited for).
PROBE = r"""
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, 0) * 1024
print(json.dumps({"rc": proc.returncode, "peak": peak, "err": proc.stderr[-2000:]}))
"""


def _peak_of_build(ckpt: Path, out: Path, *flags: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "builder.cli", "--checkpoint", str(ckpt), "--output", str(out), "--compile", "none", "--max-batch", "2",
           "--max-seq-len", "256", "--num-draft-tokens", "2", *flags]  # fmt: skip
    res = subprocess.run([sys.executable, "-c", PROBE, *cmd], env=env, capture_output=True, text=True, timeout=900)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["rc"] == 0, rec["err"]
    return rec["peak"], rec["err"]


@pytest.mark.slow
@pytest.mark.scale
def test_multi_rank_build_peak_rss_is_one_ranks_share(tmp_path):
    if shutil.disk_usage(tmp_path).free < 4 << 30:
        pytest.skip("the build RSS test needs 4 GiB free under the pytest temporary directory")
    write_sharded(tmp_path / "ckpt", CFG)
    write_tokenizer(tmp_path / "ckpt" / "tokenizer.json", CFG.vocab_size)
    plan = plan_weights(index_checkpoint(tmp_path / "ckpt"))
    share = rank_weight_bytes(plan, torch.float32, default_mapping(plan.config, 0, 4))
    largest = max(torch.Size(s).numel() * 4 for s in plan.shapes().values())
    whole = rank_weight_bytes(plan, torch.float32)
    baseline, _ = _peak_of_build(ROOT / "models" / "tiny", tmp_path / "tiny_engine")
    peak, err = _peak_of_build(tmp_path / "ckpt", tmp_path / "engine", "--world-size", "4", "--ep-size", "4")
    # the per-rank children exit on their own once they reported (killed while exiting, they left semaphores
    # behind and every multi-rank build ended with the resource tracker's "leaked semaphore objects" warning)
    assert "leaked semaphore" not in err, err
    bound = baseline + largest + share + SLACK
    print(f"\nbuild peak {peak / MiB:.0f} MiB; bound {bound / MiB:.0f} = baseline {baseline / MiB:.0f} + largest "
          f"{largest / MiB:.0f} + share {share / MiB:.0f} + slack {SLACK / MiB:.0f}; whole model {whole / MiB:.0f}")
    assert share * 3 < whole  # the bound is meaningfully below "everything"
    assert peak <= bound
