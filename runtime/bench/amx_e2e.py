"""End-to-end CPU cost of generation with linear_bf16's AMX path off vs on, per K: interleaved rounds, one process.

    OMP_NUM_THREADS=1 python -m runtime.bench.amx_e2e --engine engines/deep-aoti --prompts-file P --max-batch 8

One LLM per K (loaded once), then `--rounds` rounds of: for each K, generate every prompt (greedy, `--max-tokens`,
no prefix caching: every round prefills the same) once with AMX off (plugins.cpp_ops.amx_min_rows(1 << 30): the
paths before it) and once on (the library's threshold), in alternating order. The cost is this process's CPU time
(on a shared machine wall time mostly measures the other tenants), so tokens per CPU second, medians over rounds;
per K the median per-round ratio on / off, and each side's K / K=0. Says so when off and on differ in an output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import plugins.cpp_ops as cpp_ops
from runtime import LLM, SamplingParams

OFF = 1 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True, help="built with mtp-build --compile aoti")
    p.add_argument("--prompts-file", type=Path, required=True, help="one prompt per line")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    on = cpp_ops.amx_min_rows()
    if on == 0:
        raise SystemExit("this CPU / OS cannot run AMX")
    prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    params = SamplingParams(max_tokens=args.max_tokens)
    llms = {k: LLM(args.engine, executor="compiled", num_draft_tokens=k, max_batch=args.max_batch, threads=1,
                   enable_prefix_caching=False) for k in args.ks}  # fmt: skip
    rate: dict[tuple[int, int], list[float]] = {(k, s): [] for k in args.ks for s in (OFF, on)}
    for r in range(args.rounds):
        for k, llm in llms.items():
            texts = {}
            for side in (OFF, on) if r % 2 else (on, OFF):
                cpp_ops.amx_min_rows(side)
                t0 = time.process_time()
                outs = llm.generate(prompts, params)
                cpu = time.process_time() - t0
                texts[side] = [o.text for o in outs]
                rate[(k, side)].append(sum(len(o.token_ids) for o in outs) / cpu)
            if texts[OFF] != texts[on]:  # possible (another fp32 summation order), but worth seeing
                print(f"round {r + 1} K={k}: AMX on changed a greedy output", flush=True)
        print(f"round {r + 1} done", flush=True)
    cpp_ops.amx_min_rows(on)
    print(f"tokens per CPU second, batch {args.max_batch}, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"{args.rounds} rounds, AMX from {on} rows")  # fmt: skip
    print("| K | AMX off | AMX on | on / off | off: x K=0 | on: x K=0 |\n|---|---:|---:|---:|---:|---:|")
    k0 = args.ks[0]
    for k in args.ks:
        off_r, on_r = rate[(k, OFF)], rate[(k, on)]
        ratio = statistics.median(b / a for a, b in zip(off_r, on_r, strict=True))
        vs_off = statistics.median(off_r) / statistics.median(rate[(k0, OFF)])
        vs_on = statistics.median(on_r) / statistics.median(rate[(k0, on)])
        print(f"| {k} | {statistics.median(off_r):.0f} | {statistics.median(on_r):.0f} | {ratio:.2f} | "
              f"{vs_off:.2f} | {vs_on:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
