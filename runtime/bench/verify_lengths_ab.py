"""mtp-bench verify lengths A/B on any engine or checkpoint: every side on one shared executor, interleaved.

    OMP_NUM_THREADS=1 python -m runtime.bench.verify_lengths_ab --engine E --batches 1,8 --sides 0,3,auto,per-request

Each round runs every (batch, side) once, sides in a rotated order, over the prompts file (one prompt per line) at
--max-tokens; it reports each side's generated tokens per process CPU second (prefill included) and its ratio to
K=0's in the same round, then the median and range of the ratios. Greedy outputs of every side must equal the
first side's (an AssertionError otherwise). runtime/bench/verify_lengths_bench.py is the torch-checkpoint form."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mtp-bench-verify-lengths-ab", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", type=Path, help="engine directory (compiled executor)")
    src.add_argument("--checkpoint", type=Path, help="checkpoint directory (torch executor)")
    p.add_argument("--prompts-file", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--sides", default="0,3,auto,per-request", help="comma list; the first is the baseline")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)

    from runtime.core.sampling import SamplingParams
    from runtime.factory import create_engine

    src_kw = dict(engine_dir=args.engine, executor="compiled") if args.engine else dict(checkpoint=args.checkpoint,
                                                                                          executor="torch")  # fmt: skip
    prompts = [line for line in args.prompts_file.read_text().splitlines() if line]
    batches, sides = [int(b) for b in args.batches.split(",")], args.sides.split(",")
    owner = create_engine(**src_kw, num_draft_tokens=0, max_batch=max(batches), enable_prefix_caching=False)
    engines = {(b, k): create_engine(**src_kw, num_draft_tokens=k if k in ("auto", "per-request") else int(k),
                                     max_batch=b, enable_prefix_caching=False, share_executor_of=owner)
               for b in batches for k in sides}  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens)
    rates: dict[tuple[int, str], list[float]] = {}
    first: dict[int, list[list[int]]] = {}  # each batch's first outputs: every side must equal them
    for r in range(args.rounds):
        for b in batches:
            for k in sides[r % len(sides) :] + sides[: r % len(sides)]:
                t0 = time.process_time()
                ids = [o.output_ids for o in engines[(b, k)].generate(prompts, params)]
                rate = sum(map(len, ids)) / (time.process_time() - t0)
                assert ids == first.setdefault(b, ids), f"batch {b} side {k}: outputs differ from the first side's"
                rates.setdefault((b, k), []).append(rate)
                print(f"round {r} batch {b} K={k}: {rate:.1f} tok/CPU-s (load {os.getloadavg()[0]:.1f})", flush=True)
    for b in batches:
        for k in sides:
            ratios = sorted(x / y for x, y in zip(rates[(b, k)], rates[(b, sides[0])], strict=True))
            print(f"batch {b} K={k}: median {statistics.median(rates[(b, k)]):.1f} tok/CPU-s, ratio to K={sides[0]} "
                  f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
