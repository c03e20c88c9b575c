"""The draft loop in one call, measured in the engine (issue 27): fused against per-depth on one shared executor.

    OMP_NUM_THREADS=1 python -m runtime.bench.fused_draft --engine engines/deep-fused --prompts-file P \
        --batches 1,8 --policies 3,per-request --rounds 10

The engine must be built with `--compile aoti --num-draft-tokens K` (K >= 2, one rank), which writes the fused package
(builder/fused_draft.py). Each round runs, per batch and per-request policy (a fixed K or `per-request`), the engine
with `fused_draft=False` (one compiled call per depth) and with `fused_draft=True` (the K depths in one call wherever
the step drafts K deep and every row by argmax), in alternating order, over the prompts file (one prompt per line)
at --max-tokens, greedy, prefix caching off. It reports each form's process CPU time per generated token (prefill
included), the median and range over rounds of fused / per-depth in the same round, and how many steps took the
fused call. Greedy outputs of both forms must be equal (an AssertionError otherwise)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, cast

FORMS = ("per-depth", "fused")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mtp-bench-fused-draft", description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True, help="a --compile aoti engine with K >= 2 (one rank)")
    p.add_argument("--prompts-file", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--policies", default="3,per-request", help="comma list of --num-draft-tokens values")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=Path("bench_results/fused_draft_engine.json"))
    args = p.parse_args(argv)

    from models.engine_format.graph_io import FUSED_DRAFT
    from runtime.core.sampling import SamplingParams
    from runtime.executors.compiled_executor import CompiledExecutor
    from runtime.factory import create_engine

    prompts = [line for line in args.prompts_file.read_text().splitlines() if line]
    batches, policies = [int(b) for b in args.batches.split(",")], args.policies.split(",")
    kw: dict[str, Any] = dict(engine_dir=args.engine, executor="compiled", enable_prefix_caching=False)
    owner = create_engine(**kw, num_draft_tokens=0, max_batch=max(batches))
    if not getattr(owner.executor, "fused_draft_depths", 0):
        raise SystemExit(f"{args.engine} has no fused draft package: build it with --compile aoti, K >= 2, one rank")
    fused_calls = [0]
    cast(CompiledExecutor, owner.executor).load_fused_draft()
    ctx = cast(CompiledExecutor, owner.executor).contexts[FUSED_DRAFT]  # shared by the engines below: count its calls
    real: Any = ctx.run
    ctx.run = lambda a: (fused_calls.__setitem__(0, fused_calls[0] + 1), real(a))[1]
    engines = {(b, k, f): create_engine(**kw, num_draft_tokens=k if k == "per-request" else int(k), max_batch=b,
                                        share_executor_of=owner, fused_draft=f == "fused")
               for b in batches for k in policies for f in FORMS}  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens)
    cpu: dict[tuple[int, str, str], list[float]] = {}
    calls: dict[tuple[int, str, str], list[int]] = {}
    for r in range(args.rounds):
        for b in batches:
            for k in policies:
                first = None
                for f in FORMS if r % 2 == 0 else FORMS[::-1]:
                    c0, t0 = fused_calls[0], time.process_time()
                    ids = [o.output_ids for o in engines[(b, k, f)].generate(prompts, params)]
                    ms = 1e3 * (time.process_time() - t0) / sum(map(len, ids))
                    first = first or ids
                    assert ids == first, f"batch {b} K={k}: the {f} outputs differ from the other form's"
                    cpu.setdefault((b, k, f), []).append(ms)
                    calls.setdefault((b, k, f), []).append(fused_calls[0] - c0)
                    print(f"round {r} batch {b} K={k} {f}: {ms:.3f} CPU-ms/token, {fused_calls[0] - c0} fused calls "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for b in batches:
        for k in policies:
            per_depth, fused = cpu[(b, k, "per-depth")], cpu[(b, k, "fused")]
            ratios = sorted(y / x for x, y in zip(per_depth, fused, strict=True))
            rows.append({"batch": b, "policy": k, "per_depth_ms": statistics.median(per_depth),
                         "fused_ms": statistics.median(fused),
                         "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
                         "fused_calls": statistics.median(calls[(b, k, "fused")])})  # fmt: skip
    print("| batch | K | per-depth CPU-ms/token | fused CPU-ms/token | fused / per-depth (range) | fused calls per run |\n"
          "|---|---|---:|---:|---:|---:|")  # fmt: skip
    for w in rows:
        print(f"| {w['batch']} | {w['policy']} | {w['per_depth_ms']:.3f} | {w['fused_ms']:.3f} | {w['ratio_median']:.3f} "
              f"({w['ratio_min']:.3f}-{w['ratio_max']:.3f}) | {w['fused_calls']:.0f} |")  # fmt: skip
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                     "per_round_ms": {f"{b} {k} {f}": v for (b, k, f), v in cpu.items()},
                                     "load_average": load}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
