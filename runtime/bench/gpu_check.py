"""`python -m runtime.bench.gpu_check` (part of `make gpu-check`): the whole engine on a CUDA device.

Runs the shipped tiny model greedy with the torch executor on CUDA, with CUDA graphs per request bucket
(runtime/executors/cuda_graphs.py), for K = 0 and K = 3, and checks the outputs equal the CPU engine's
(informational: fp32 rounding differs across devices, so a near-tie can legitimately flip), and that
K = 3 equals K = 0 on the GPU token for token (losslessness, the pass/fail criterion). Reports tokens/s, acceptance, and which graph buckets were captured or
fell back to eager. Prints one JSON object; without CUDA it prints {"skipped": ...} and exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from runtime.bench.report import first_mismatch
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"
PROMPTS = ["def main(argv=None):\n    ", "class Stack:\n    def push(self, item):\n        ", "import os\n\n\n",
           "    for key, value in sorted(mapping.items()):\n        "]  # fmt: skip


def run(device: str, k: int, cuda_graphs: bool) -> tuple[list[list[int]], dict]:
    engine = create_engine(checkpoint=TINY, executor="torch", device=device, cuda_graphs=cuda_graphs,
                           num_draft_tokens=k, max_batch=4, max_seq_len=256, block_size=16, num_blocks=128)  # fmt: skip
    t0 = time.perf_counter()
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=64))
    wall = time.perf_counter() - t0
    info = engine.metrics.summary(wall, len(PROMPTS))
    ex = engine.executor
    for name in ("graphed_draft", "graphed_verify"):
        graphed = getattr(ex, name, None)
        if graphed is not None:
            info[name] = {str(b): ("captured" if g is not None else "eager fallback") for b, g in graphed.graphs.items()}
    return [o.output_ids for o in outs], info


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: skipping the engine GPU check"}))
        return 0
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    cpu_k0, _ = run("cpu", 0, False)
    gpu = {k: run("cuda", k, True) for k in (0, 3)}
    for k, (_, info) in gpu.items():
        report[f"cuda K={k}"] = info
    report["cuda K=0 vs cpu K=0 (informational)"] = first_mismatch(gpu[0][0], cpu_k0) or "equal"
    lossless = first_mismatch(gpu[3][0], gpu[0][0])
    report["lossless cuda K=3 vs cuda K=0"] = lossless or "equal"
    print(json.dumps(report, indent=2))
    return 1 if lossless else 0


if __name__ == "__main__":
    sys.exit(main())
