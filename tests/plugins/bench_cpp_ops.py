"""Per-call time of each plugin op's CPU path: this checkout against another (e.g. a checkout of the previous
vectorized-torch ops), interleaved rounds, 1 thread, medians. Not a test (timings never assert anything).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.plugins.bench_cpp_ops --baseline ../main --rounds 7

Each round runs one child process per checkout (baseline first, then this one; the order alternates), which
times every case `--calls` times back to back and reports its median µs per call; the table prints the
median over rounds. Shapes: models/deep (8 q heads / 2 KV heads of 32, hidden 256, 8 experts top-2,
moe_intermediate 96, block 16) at batch 1 and 8 with 1, 2 and 4 rows per request over a 128-token context,
a 256-token prefill, and an MLA layer of GLM-4.7-Flash's latent width (512 + 64 rope, 20 heads). Metadata is the same at every
call, as for the layers of one forward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTEXT = 128


def _cases():
    import torch

    import plugins.mla_ops  # noqa: F401
    import plugins.ops  # noqa: F401
    from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

    gen = torch.Generator().manual_seed(0)
    cases = {}
    for batch, rows, context in ((1, 1, CONTEXT), (1, 2, CONTEXT), (1, 4, CONTEXT), (8, 1, CONTEXT), (8, 2, CONTEXT),
                                 (8, 4, CONTEXT), (1, 256, 0)):
        t = batch * rows
        blocks = (context + rows + 15) // 16
        geom = KVPoolGeometry(2, 1 + batch * blocks, 16, 2, 32, 0)
        pool = allocate_pool(geom)
        ptr = pool_address(pool)
        tables = (1 + torch.arange(batch * blocks, dtype=torch.int32)).view(batch, blocks)
        counts = torch.full((batch,), rows, dtype=torch.int32)
        starts = torch.full((batch,), context, dtype=torch.int32)
        k, v, q = torch.randn(t, 2, 32, generator=gen), torch.randn(t, 2, 32, generator=gen), torch.randn(t, 8, 32)
        attrs = tuple(geom.attrs().values())
        after = torch.ones(1, dtype=torch.int64)
        tag = f"b{batch}x{rows}" + ("" if context else " prefill")
        cases[f"kv_write {tag}"] = (torch.ops.mtp.kv_write, (k, v, counts, starts, tables, ptr, 1, *attrs, 0, 0.0), pool)
        cases[f"paged_attention {tag}"] = (torch.ops.mtp.paged_attention, (q, counts, starts + counts, tables, ptr,
                                                                            after, 1, *attrs, 32**-0.5), pool)  # fmt: skip
        x = torch.randn(t, 256, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(t)])
        w = torch.rand(t, 2, generator=gen)
        for wdt in (torch.float32, torch.bfloat16):
            gu = (torch.randn(8, 192, 256, generator=gen) / 16).to(wdt)
            dn = (torch.randn(8, 256, 96, generator=gen) / 10).to(wdt)
            name = f"moe_experts {tag} {'bf16' if wdt == torch.bfloat16 else 'fp32'} w"
            cases[name] = (torch.ops.mtp.moe_experts, (x, ids, w, gu, dn, 8, 1), None)
        if batch == 1 and context:
            mgeom = KVPoolGeometry(1, 1 + blocks, 16, 1, 576, 0, kv_kind=1)
            mpool = allocate_pool(mgeom)
            mptr, mattrs = pool_address(mpool), tuple(mgeom.attrs().values())
            inv = torch.rand(32, generator=gen)
            lat, mq = torch.randn(t, 576, generator=gen), torch.randn(t, 20, 576, generator=gen)
            cases[f"mla_kv_write {tag}"] = (torch.ops.mtp.mla_kv_write, (lat, counts, starts, tables, mptr, inv, 0,
                                                                          *mattrs, 64, 1.0), mpool)  # fmt: skip
            cases[f"mla_paged_attention {tag}"] = (torch.ops.mtp.mla_paged_attention, (mq, counts, starts + counts,
                                                   tables, mptr, after, 0, *mattrs, 64, 0.07), mpool)  # fmt: skip
    return cases


def child(calls: int) -> None:
    """Time every case in this process (the checkout on PYTHONPATH); print {case: median µs per call}."""
    import torch

    torch.set_num_threads(1)
    out = {}
    with torch.inference_mode():
        for name, (op, args, _pool) in _cases().items():
            for _ in range(5):
                op(*args)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                op(*args)
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times) * 1e6
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other checkout's root (its ops on PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.calls)
        return
    here = Path(__file__).resolve().parents[2]
    roots = {"before": Path(args.baseline).resolve(), "after": here}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
            env = dict(os.environ, PYTHONPATH=str(roots[which]), OMP_NUM_THREADS="1")
            cmd = [sys.executable, str(here / "tests/plugins/bench_cpp_ops.py"), "--baseline", ".", "--child",
                   "--calls", str(args.calls)]  # fmt: skip
            res = subprocess.run(cmd, env=env, cwd=roots[which], capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{which} ({roots[which]}) failed: {res.stderr.strip().splitlines()[-1]}")
            runs[which].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"{'case':40s} {'before us':>10s} {'after us':>10s} {'speed-up':>9s}")
    for name in runs["after"][0]:
        before = statistics.median(run[name] for run in runs["before"])
        after = statistics.median(run[name] for run in runs["after"])
        print(f"{name:40s} {before:10.1f} {after:10.1f} {before / after:8.1f}x")


if __name__ == "__main__":
    main()
