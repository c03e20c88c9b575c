"""One round of mtp-bench's decode runs, printed as one JSON line: for timing two checkouts of this project against
each other on one machine (docs/BENCHMARKS.md, "No loss on the shipped model").

The same held-out prompts, engines (one shared executor for every K, sized for the largest K and batch), warm-up
and runs as `mtp-bench` (runtime/bench/setup.py, runners.py); per (batch, K): decode tok/s by wall clock and by
process CPU time of the decode-only steps, and the greedy outputs, so two trees' outputs can be compared. Each tree
runs this file against its own code (bench, runtime and C++ kernels), rounds of the two alternating:

    PYTHONPATH=TREE python -P runtime/bench/decode_round.py --checkpoint models/deep --engine ENGINE

-P: the file's folder would otherwise come first on sys.path and shadow packages with its modules' names (gguf).
It calls only what mtp-bench has had since before the quantized formats (commit aa41044), so that tree runs it too.
One thread (make bench's BENCH_THREADS).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from runtime.bench.runners import make_workload, run_engine, warm_up
from runtime.bench.setup import engine_factory
from runtime.factory import load_tokenizer


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--engine", type=Path, default=None, help="engine directory (compiled, onnxruntime)")
    p.add_argument("--executor", default="compiled", choices=["compiled", "onnxruntime", "torch"])
    p.add_argument("--ks", type=parse_ints, default=[0, 3], help="draft depths (default 0,3)")
    p.add_argument("--batches", type=parse_ints, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # the plugin ops' and ORT's OpenMP; before any engine starts a pool
    torch.set_num_threads(1)
    vocab_size = int(json.loads((args.checkpoint / "config.json").read_text())["vocab_size"])
    work = make_workload(args.checkpoint, args.num_prompts, args.prompt_chars, vocab_size,
                         load_tokenizer(args.checkpoint))  # fmt: skip
    engine_for = engine_factory(argparse.Namespace(int_ks=args.ks, batches=args.batches, max_tokens=args.max_tokens,
                                                   max_seq_len=None, threads=1, engine=args.engine,
                                                   checkpoint=args.checkpoint), work)  # fmt: skip
    engines = {k: engine_for(args.executor, str(k)) for k in args.ks}
    for engine in engines.values():
        warm_up(engine, work.prompts)
    runs = {}
    for b in args.batches:
        for k in args.ks:
            r = run_engine(engines[k], work.prompts, b, args.max_tokens, f"b{b}k{k}")
            runs[f"b{b}_k{k}"] = {"decode_tps": round(r.decode_tps, 2), "decode_cpu_tps": round(r.decode_cpu_tps, 2),
                                  "decode_tokens": r.decode_tokens, "decode_steps": r.decode_steps,
                                  "e2e_tps": round(r.total_tokens / r.wall_seconds, 2), "outputs": r.outputs}  # fmt: skip
    print(json.dumps({"load_average": os.getloadavg(), "prompt_files": work.sources, "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
