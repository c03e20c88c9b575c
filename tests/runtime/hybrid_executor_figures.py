"""Figures of the compiled hybrid engine against the ONNX Runtime one (docs/MODELS.md): end-to-end generated
tokens per second of the same engine directory on each executor, K=0 and K=2, medians of interleaved rounds.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/runtime/hybrid_executor_figures.py [--rounds 3] [--batch 1 4]

The random Qwen3-Next checkpoint of hybrid_prefix_figures.py (`DEEP`: hidden 256, 6 GDN + 2 gated attention layers,
8 experts), built by `mtp-build` with its defaults (compiled packages), K=2 and `--keep-onnx` (so the ONNX Runtime
executor runs the same directory); prompts of 32 random tokens, 48 new tokens each, greedy (every executor's ids are
checked equal).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from builder import cli
from models.testing import make_hybrid_checkpoint
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts
from tests.runtime.hybrid_prefix_figures import DEEP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    make_hybrid_checkpoint(root / "ckpt", "qwen3_next", seed=2, **DEEP)
    t0 = time.perf_counter()
    assert cli.main(["--checkpoint", str(root / "ckpt"), "--output", str(root / "engine"), "--max-batch", "4",
                     "--max-seq-len", "128", "--num-draft-tokens", "2", "--keep-onnx"]) == 0  # fmt: skip
    print(f"build (with the compiled packages): {time.perf_counter() - t0:.0f} s")
    params = SamplingParams(max_tokens=48)
    engines = {(ex, k): create_engine(engine_dir=root / "engine", executor=ex, num_draft_tokens=k,
                                      enable_prefix_caching=False)
               for ex in ("onnxruntime", "compiled") for k in (0, 2)}  # fmt: skip
    for batch in args.batch:
        prompts = random_prompts((32,) * batch, vocab=64, seed=batch)
        seconds: dict = {key: [] for key in engines}
        ids: dict = {}
        for _ in range(args.rounds):
            for key, engine in engines.items():
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params)
                seconds[key].append(time.perf_counter() - t0)
                ids[key] = [o.output_ids for o in outs]
        assert all(v == ids[("onnxruntime", 0)] for v in ids.values()), "the executors disagree"
        tokens = sum(len(t) for t in ids[("onnxruntime", 0)])
        rate = {key: tokens / statistics.median(s) for key, s in seconds.items()}
        for k in (0, 2):
            ort, comp = rate[("onnxruntime", k)], rate[("compiled", k)]
            print(f"batch {batch} K={k}: onnxruntime {ort:7.1f} tok/s, compiled {comp:7.1f} tok/s, {comp / ort:.2f}x")


if __name__ == "__main__":
    main()
