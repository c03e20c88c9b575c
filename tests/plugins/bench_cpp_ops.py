"""Per-call time of each plugin op's CPU path: this checkout against another (e.g. a checkout of the previous
vectorized-torch ops), or this checkout at several thread counts; interleaved rounds, medians. Not a test (timings
never assert anything).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.plugins.bench_cpp_ops --baseline ../main --rounds 7
    PYTHONPATH=$PWD .venv/bin/python -m tests.plugins.bench_cpp_ops --threads 1,2 --big --rounds 7

Each round runs one child process per variant (checkout or thread count; the order alternates), which times every
case `--calls` times back to back and reports its median µs per call; the table prints the median over rounds.
Checkouts run at 1 thread; OMP_WAIT_POLICY is PASSIVE unless set, as the runtime sets it. Shapes: models/deep (8 q heads / 2 KV heads of 32, hidden 256, 8 experts top-2,
moe_intermediate 96, block 16) at batch 1 and 8 with 1, 2 and 4 rows per request over a 128-token context,
a 256-token prefill, and an MLA layer of GLM-4.7-Flash's latent width (512 + 64 rope, 20 heads). --big adds shapes
where the kernels split over threads (common.h kMinThreadWork): GQA 32 q / 8 KV heads of 128 over 2048 positions,
MoE hidden 2048 x moe_intermediate 768 with 16 experts top-8 (bf16, FP8 and int8 weights), a GDN layer of Qwen3-Next's
geometry (16 k / 32 v heads of 128), a 512-row KV write of 8 heads x 128. Metadata is the same at every call, as for
the layers of one forward.
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


def _big_cases():
    """Shapes where the kernels split over threads (real models' widths)."""
    import torch

    import plugins.gdn_ops  # noqa: F401
    import plugins.ops  # noqa: F401
    from models.fp8 import quantize
    from plugins.gdn_pool import GDNPoolGeometry, address
    from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
    from plugins.reference import quantize_int8

    gen = torch.Generator().manual_seed(1)
    cases = {}
    ctx, bs = 2048, 16
    for batch, rows in ((1, 1), (1, 4), (8, 1), (8, 4)):
        t, blocks = batch * rows, (ctx + rows + bs - 1) // bs
        geom = KVPoolGeometry(1, 1 + batch * blocks, bs, 8, 128, 2)
        pool = allocate_pool(geom)
        pool.normal_(generator=gen)
        tables = (1 + torch.arange(batch * blocks, dtype=torch.int32)).view(batch, blocks)
        counts = torch.full((batch,), rows, dtype=torch.int32)
        q, after = torch.randn(t, 32, 128, generator=gen), torch.ones(1, dtype=torch.int64)
        args = (q, counts, counts + ctx, tables, pool_address(pool), after, 0, *geom.attrs().values(), 128**-0.5)
        cases[f"paged_attention big b{batch}x{rows}"] = (torch.ops.mtp.paged_attention, args, pool)
    hidden, inter, experts, top_k = 2048, 768, 16, 8
    gu = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    dn = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).bfloat16()
    fp8 = []
    for e in range(experts):  # gate and up quantized on their own, as the releases ship them
        (qg, sg), (qu, su) = quantize(gu[e, :inter].float()), quantize(gu[e, inter:].float())
        fp8.append((torch.cat([qg, qu]), torch.cat([sg, su]), *quantize(dn[e].float())))
    fgu, fsgu, fdn, fsdn = (torch.stack([f[i] for f in fp8]) for i in range(4))
    (igu, isgu), (idn, isdn) = quantize_int8(gu), quantize_int8(dn)  # what `mtp-build --quantize int8` stores
    for tokens in (1, 4, 32):
        x = torch.randn(tokens, hidden, generator=gen)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        w = torch.rand(tokens, top_k, generator=gen)
        cases[f"moe_experts big t{tokens} bf16 w"] = (torch.ops.mtp.moe_experts, (x, ids, w, gu, dn, experts, 1), None)
        cases[f"moe_experts_fp8 big t{tokens}"] = (torch.ops.mtp.moe_experts_fp8, (x, ids, w, fgu, fsgu, fdn, fsdn, 0),
                                                   None)  # fmt: skip
        cases[f"moe_experts_int8 big t{tokens}"] = (torch.ops.mtp.moe_experts_int8, (x, ids, w, igu, isgu, idn, isdn,
                                                    0), None)  # fmt: skip
    hk, dk, hv, dv, kk = 16, 128, 32, 128, 4
    c = 2 * hk * dk + hv * dv
    for batch, rows in ((1, 1), (4, 1), (4, 4)):
        t = batch * rows
        geom = GDNPoolGeometry(1, batch * rows + batch, c, kk, hk, hv, dk, dv)
        conv, ssm = torch.randn(geom.conv_shape, generator=gen), 0.1 * torch.randn(geom.ssm_shape, generator=gen)
        counts = torch.full((batch,), rows, dtype=torch.int32)
        starts = torch.full((batch,), 100, dtype=torch.int32)
        reads = torch.arange(batch, dtype=torch.int32)
        writes = torch.arange(batch, batch + t, dtype=torch.int32)  # never a slot some request reads
        args = (torch.randn(t, c, generator=gen), torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen),
                counts, starts, reads, writes, address(conv), address(ssm), 0.3 * torch.randn(c, kk, generator=gen),
                torch.randn(hv, generator=gen), torch.randn(hv, generator=gen))  # fmt: skip
        cases[f"gdn_step big b{batch}x{rows}"] = (lambda *a, g=geom: torch.ops.mtp.gdn_step(*a, **g.attrs(0)), args,
                                                  (conv, ssm))  # fmt: skip
    geom = KVPoolGeometry(1, 1 + 32, 16, 8, 128, 2)
    pool = allocate_pool(geom)
    k, v = torch.randn(512, 8, 128, generator=gen), torch.randn(512, 8, 128, generator=gen)
    one = torch.ones(1, dtype=torch.int32)
    tables = (1 + torch.arange(32, dtype=torch.int32)).view(1, 32)
    cases["kv_write big prefill 512 rope"] = (torch.ops.mtp.kv_write, (k, v, one * 512, one * 0, tables,
                                              pool_address(pool), 0, *geom.attrs().values(), 128, 1e6), pool)  # fmt: skip
    return cases


def child(calls: int, threads: int, big: bool) -> None:
    """Time every case in this process (the checkout on PYTHONPATH); print {case: median µs per call}."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    with torch.inference_mode():
        for name, (op, args, _pool) in {**_cases(), **(_big_cases() if big else {})}.items():
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
    ap.add_argument("--baseline", help="the other checkout's root (its ops on PYTHONPATH); runs at 1 thread")
    ap.add_argument("--threads", help="instead of --baseline: thread counts of this checkout to compare, e.g. 1,2")
    ap.add_argument("--big", action="store_true", help="add the shapes where the kernels split over threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.calls, args.child_threads, args.big)
        return
    if (args.baseline is None) == (args.threads is None):
        ap.error("give --baseline or --threads")
    here = Path(__file__).resolve().parents[2]
    if args.threads:  # variant name -> (checkout, threads)
        variants = {f"{n} thr": (here, int(n)) for n in args.threads.split(",")}
    else:
        variants = {"before": (Path(args.baseline).resolve(), 1), "after": (here, 1)}
    names = list(variants)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for which in names if r % 2 == 0 else names[::-1]:
            root, threads = variants[which]
            env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads))
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `import runtime` sets (docs/PERFORMANCE.md "Threads")
            cmd = [sys.executable, str(here / "tests/plugins/bench_cpp_ops.py"), "--child", "--calls", str(args.calls),
                   "--child-threads", str(threads)] + (["--big"] if args.big else [])  # fmt: skip
            res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{which} ({root}) failed: {res.stderr.strip().splitlines()[-1]}")
            runs[which].append(json.loads(res.stdout.strip().splitlines()[-1]))
    first, last = names[0], names[-1]
    print(f"{'case':40s} " + " ".join(f"{n + ' us':>10s}" for n in names) + f" {first + '/' + last:>12s}")
    for case in runs[last][0]:
        med = {n: statistics.median(run[case] for run in runs[n]) for n in names}
        print(f"{case:40s} " + " ".join(f"{med[n]:10.1f}" for n in names) + f" {med[first] / med[last]:11.2f}x")


if __name__ == "__main__":
    main()
