"""End-to-end tokens per CPU second of the compiled engine, K = 0..3 at batch 1 and 8, with the C++ kernels'
portable path against the best one the CPU has (plugins.cpp_ops.cpu_isa), in one process: the same engine
packages and prompts, rounds alternating the ISA order. Not a test (timings never assert anything).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.plugins.bench_isa_e2e \
        --checkpoint models/deep --engine engines/bench-deep --rounds 3

Time is this process's CPU time (time.process_time) over a whole run (prefill included): on the shared 2-core
machine wall time mostly measures the other tenants. Every K's greedy output must equal K=0's under both paths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import plugins.cpp_ops as cpp_ops
from runtime.bench.runners import make_workload, run_engine
from runtime.bench.setup import token_budget
from runtime.factory import create_engine, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--engine", type=Path, required=True, help="built with mtp-build --compile aoti")
    ap.add_argument("--ks", default="0,1,2,3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ks, batches = [int(k) for k in args.ks.split(",")], [int(b) for b in args.batches.split(",")]
    vocab = int(json.loads((args.checkpoint / "config.json").read_text())["vocab_size"])
    work = make_workload(args.checkpoint, args.num_prompts, 200, vocab, load_tokenizer(args.checkpoint))
    engines = {k: create_engine(args.engine, args.checkpoint, "compiled", num_draft_tokens=k, max_batch=max(batches),
                                enable_prefix_caching=False, max_num_tokens=token_budget(max(batches), max(ks)))
               for k in ks}  # fmt: skip
    isas = ["generic", cpp_ops.cpu_isa("best")]
    for k, eng in engines.items():  # warm-up (first-call costs of the packages)
        run_engine(eng, work.prompts[:2], 2, 8, f"warm{k}")
    rate: dict[tuple[str, int, int], list[float]] = {}
    ref: dict[int, list[list[int]]] = {}
    for r in range(args.rounds):
        for isa in isas if r % 2 == 0 else isas[::-1]:
            cpp_ops.cpu_isa(isa)
            for b in batches:
                for k, eng in engines.items():
                    t0 = time.process_time()
                    res = run_engine(eng, work.prompts, b, args.max_tokens, f"{isa}{k}b{b}r{r}")
                    cpu = time.process_time() - t0
                    rate.setdefault((isa, b, k), []).append(res.total_tokens / cpu)
                    want = ref.setdefault(b, res.outputs) if k == 0 else ref[b]
                    assert res.outputs == want, f"{isa} K={k} batch {b}: output differs from K=0"
    cpp_ops.cpu_isa("best")
    print(f"{'isa':8s} {'batch':>5s} {'K':>2s} {'tok/CPU s':>10s} {'vs K=0':>7s}")
    for isa in isas:
        for b in batches:
            base = statistics.median(rate[(isa, b, 0)])
            for k in ks:
                v = statistics.median(rate[(isa, b, k)])
                print(f"{isa:8s} {b:5d} {k:2d} {v:10.1f} {v / base:6.2f}x")


if __name__ == "__main__":
    main()
