"""Per-op CPU ms of the compiled engine's verify forward, per (batch, rows per request): what grows with rows.

    OMP_NUM_THREADS=1 python -m runtime.bench.compiled_profile --engine engines/bench-deep \
        --shapes 1x1,1x2,1x3,1x4,8x1,8x2,8x4

The same step as runtime.bench.compiled_compare (a prefill of `--context` tokens per request, then one `run_main`
of `rows` rows per request) on the engine's AOTInductor packages, run `--iters` times under torch.profiler: one
table, a column per shape, the self CPU ms per forward of every op that costs at least `--min-ms` in some shape
(the plugin ops `mtp::*` are the kernels of plugins/csrc/), and the whole forward's CPU ms (process time, median).

`--ab R` instead times the forward per shape with linear_bf16's AMX path off (threshold 1 << 30: the register-tile
and MKL paths, as before it) and on (`--amx-min-rows`, default the library's), in R interleaved rounds in this one
process: median CPU ms of each and the median of the per-round ratios off / on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import plugins.cpp_ops as cpp_ops
from runtime.bench.compiled_compare import step_inputs
from runtime.executors.compiled_executor import CompiledExecutor


def profile_shape(ex: CompiledExecutor, batch: int, rows: int, context: int, iters: int) -> tuple[dict, float]:
    """({op: self CPU ms per forward}, median forward CPU ms) of one verify step shape."""
    cfg = ex.config
    prefills, step, need = step_inputs(batch, rows, context, cfg.kv.block_size, cfg.kv.table_width,
                                      cfg.model.vocab_size, ex.state is not None)  # fmt: skip
    if need > cfg.kv.num_blocks:
        raise SystemExit(f"batch {batch} needs {need} blocks, the engine has {cfg.kv.num_blocks}")
    for prefill in prefills:
        ex.run_main(prefill)
    for _ in range(3):  # warm-up
        ex.run_main(step)
    forward_ms = _median_forward_ms(ex, step, iters)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            ex.run_main(step)
    ops = {e.key: e.self_cpu_time_total / 1e3 / iters for e in prof.key_averages()}
    return ops, forward_ms


def _median_forward_ms(ex: CompiledExecutor, step, iters: int) -> float:
    """Median CPU ms of `iters` verify forwards of `step`."""
    ts = []
    for _ in range(iters):
        t0 = time.process_time()
        ex.run_main(step)
        ts.append(time.process_time() - t0)
    return statistics.median(ts) * 1e3


def ab_shape(ex: CompiledExecutor, batch: int, rows: int, context: int, iters: int, rounds: int, on: int):
    """(median ms AMX off, median ms AMX on, median per-round off / on) of one shape, interleaved rounds."""
    cfg = ex.config
    prefills, step, _ = step_inputs(batch, rows, context, cfg.kv.block_size, cfg.kv.table_width,
                                    cfg.model.vocab_size, ex.state is not None)  # fmt: skip
    for prefill in prefills:
        ex.run_main(prefill)
    got: dict[int, list[float]] = {1 << 30: [], on: []}
    for r in range(rounds):
        for thr in (1 << 30, on) if r % 2 else (on, 1 << 30):  # alternate which goes first
            cpp_ops.amx_min_rows(thr)
            ex.run_main(step)
            got[thr].append(_median_forward_ms(ex, step, iters))
    cpp_ops.amx_min_rows(on)
    off_ms, on_ms = got[1 << 30], got[on]
    ratio = statistics.median(a / b for a, b in zip(off_ms, on_ms, strict=True))
    return statistics.median(off_ms), statistics.median(on_ms), ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True, help="built with mtp-build --compile aoti")
    p.add_argument("--shapes", default="1x1,1x2,1x3,1x4,8x1,8x2,8x4", help="batch x rows per request, comma separated")
    p.add_argument("--context", type=int, default=90)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--amx-min-rows",
        type=int,
        default=-1,
        help="linear_bf16's AMX row threshold (plugins.cpp_ops.amx_min_rows; 1 << 30: never)",
    )
    p.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="A/B the forward, AMX off vs on")
    p.add_argument("--min-ms", type=float, default=0.02, help="leave out ops below this in every shape")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"AMX from {cpp_ops.amx_min_rows(args.amx_min_rows)} rows (0: no AMX)")
    ex = CompiledExecutor(args.engine)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.ab:
        on = cpp_ops.amx_min_rows()
        if on == 0:
            raise SystemExit("this CPU / OS cannot run AMX")
        print(f"verify forward CPU ms, AMX off vs on (from {on} rows), {args.ab} rounds x {args.iters}, 1 thread")
        print("| batch x rows | AMX off | AMX on | off / on |\n|---|---:|---:|---:|")
        for batch, rows in shapes:
            off_ms, on_ms, ratio = ab_shape(ex, batch, rows, args.context, args.iters, args.ab, on)
            print(f"| {batch}x{rows} | {off_ms:.3f} | {on_ms:.3f} | {ratio:.2f} |", flush=True)
        return 0
    cols, totals = [], []
    for batch, rows in shapes:
        ops, total = profile_shape(ex, batch, rows, args.context, args.iters)
        cols.append(ops)
        totals.append(total)
    names = sorted({k for c in cols for k, v in c.items() if v >= args.min_ms}, key=lambda k: -cols[-1].get(k, 0.0))
    print(f"self CPU ms per verify forward, {args.iters} forwards, context {args.context}, 1 thread")
    print("| op | " + " | ".join(f"{b}x{r}" for b, r in shapes) + " |")
    print("|---|" + "---:|" * len(shapes))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{c.get(k, 0.0):.3f}" for c in cols) + " |")
    print("| forward (process time, median) | " + " | ".join(f"{t:.3f}" for t in totals) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
