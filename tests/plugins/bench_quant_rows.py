"""The weight-only kernels at one activation row (decode, batch 1), GLM-4.5-Air's shapes, one ISA: effective GB/s of
the bytes each format stores, against the single-thread read bandwidth probe of the realistic-size bench
(runtime/bench/realsize.py measure_bandwidth). Not a test (timings never assert anything).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.plugins.bench_quant_rows --isa avx512 --rounds 7
    PYTHONPATH=$PWD .venv/bin/python -m tests.plugins.bench_quant_rows --dump /tmp/new.pt   # outputs, every ISA
    PYTHONPATH=$PWD .venv/bin/python -m tests.plugins.bench_quant_rows --compare /tmp/old.pt /tmp/new.pt

Each (op, shape) streams `--cold-bytes` of distinct weights in turn (random values in the stored form: the kernels'
time does not depend on them), so every call reads its weights from DRAM; a round's time is the median over `--iters`
passes, the table the median over rounds, the probe interleaved with them (its best, as the realistic-size bench).
Times are the thread's CPU time, the probe's too: on a shared machine, wall time counts the turns other processes
take on the core.
`--dump` writes the kernels' outputs on fixed random inputs (every format, row counts 1-5, tails, NaN FP8 bytes,
experts) for each ISA; `--compare` says whether two dumps (two builds of the library) are bit for bit equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

import plugins.cpp_ops
import plugins.ops  # noqa: F401  (the ops' schemas)
from runtime.bench.realsize import measure_bandwidth

HIDDEN, Q, KV, DENSE, EXPERT = 4096, 96 * 128, 8 * 128, 10944, 1408  # GLM-4.5-Air (runtime/bench/realsize_ckpt.py)
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * DENSE, HIDDEN), "down": (HIDDEN, DENSE)}
GROUP = 64  # mtp-build's int4 group
EXPERTS, TOP_K = 8, 4  # the bench checkpoint's routed experts


def _stored(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[tuple, int]:
    """Random weights [n, k] in `fmt`'s stored form and their bytes (scales included)."""
    if fmt == "bf16":
        return (torch.randn(n, k, generator=gen).mul_(0.02).bfloat16(),), 2 * n * k
    if fmt == "int8":
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        return (w, torch.rand(n, generator=gen) * 1e-3), n * k + 4 * n
    if fmt == "int4":
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return (w, torch.rand(n, k // GROUP, generator=gen) * 1e-3), n * k // 2 + 4 * n * (k // GROUP)
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    w[(w & 0x7F) == 0x7F] = 0  # no NaN bytes: a real checkpoint's
    s = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-3
    return (w.view(torch.float8_e4m3fn), s), n * k + 4 * s.numel()


def _linear(fmt: str) -> Callable[..., torch.Tensor]:
    return {
        "bf16": lambda x, w: torch.ops.mtp.linear_bf16(x, w[0], None),
        "int8": lambda x, w: torch.ops.mtp.linear_int8(x, w[0], w[1], None),
        "int4": lambda x, w: torch.ops.mtp.linear_int4(x, w[0], w[1], GROUP, None),
        "fp8": lambda x, w: torch.ops.mtp.linear_fp8(x, w[0], w[1], None),
    }[fmt]


def _experts(fmt: str, e: int, h: int, inter: int, gen: torch.Generator) -> tuple[tuple, int]:
    """One layer's e experts in `fmt` (FP8: gate and up blocked on their own) and the bytes one expert stores."""
    gate, up, down = (_stored(fmt, r, c, gen) for r, c in ((inter, h), (inter, h), (h, inter)))
    gu = [torch.cat([a, b]) for a, b in zip(gate[0], up[0], strict=True)]
    gu[0] = gu[0].view(torch.uint8) if fmt == "fp8" else gu[0]
    dn = down[0][0].view(torch.uint8) if fmt == "fp8" else down[0][0]
    ws = (torch.stack([gu[0]] * e), torch.stack([gu[1]] * e), torch.stack([dn] * e), torch.stack([down[0][1]] * e))
    return ws, gate[1] + up[1] + down[1]


def _moe(fmt: str) -> Callable[..., torch.Tensor]:
    return {
        "int8": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_int8(x, ids, tw, *w, 0),
        "int4": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_int4(x, ids, tw, *w, GROUP, 0),
        "fp8": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_fp8(x, ids, tw, *w, 0),
    }[fmt]


def _time(calls: list[Callable[[], object]], iters: int) -> float:
    """Median over `iters` passes of the mean seconds per call over `calls` (distinct weights, cold)."""
    per = []
    for _ in range(iters):
        t0 = time.thread_time()
        for c in calls:
            c()
        per.append((time.thread_time() - t0) / len(calls))
    return statistics.median(per)


def bench(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    print(
        f"isa {plugins.cpp_ops.cpu_isa(a.isa)}, 1 thread, 1 activation row, thread CPU time, load average {os.getloadavg()[0]:.1f}"
    )
    gen = torch.Generator().manual_seed(0)
    cases: dict[str, tuple[list[Callable[[], object]], int]] = {}
    for fmt in a.formats:
        for name in a.shapes:
            n, k = SHAPES[name]
            w0, size = _stored(fmt, n, k, gen)
            ws = [w0] + [tuple(t.clone() for t in w0) for _ in range(max(1, a.cold_bytes // size) - 1)]
            x, linear = torch.randn(1, k, generator=gen), _linear(fmt)
            cases[f"linear_{fmt} {name} {n}x{k}"] = ([partial(linear, x, w) for w in ws], size)
        if fmt != "bf16" and a.moe:
            one, per_expert = _experts(fmt, EXPERTS, HIDDEN, EXPERT, gen)
            # cold_bytes of what the calls read (TOP_K experts each); every set holds all EXPERTS
            copies = max(1, a.cold_bytes // (TOP_K * per_expert)) - 1
            sets = [one] + [tuple(t.clone() for t in one) for _ in range(copies)]
            x, ids = torch.randn(1, HIDDEN, generator=gen), torch.randperm(EXPERTS, generator=gen)[:TOP_K][None]
            tw, moe = torch.rand(1, TOP_K, generator=gen), _moe(fmt)
            cases[f"moe_experts_{fmt} top-{TOP_K}"] = ([partial(moe, x, ids, tw, s) for s in sets], TOP_K * per_expert)
    for calls, _ in cases.values():  # warm-up: scratch, first touch
        calls[0]()
    times: dict[str, list[float]] = {c: [] for c in cases}
    bandwidth = []
    names = list(cases)
    for r in range(a.rounds):
        bandwidth.append(measure_bandwidth(512 << 20, 1, time.thread_time))
        for c in names[r % len(names) :] + names[: r % len(names)]:
            times[c].append(_time(cases[c][0], a.iters))
    bw = max(bandwidth)
    print(f"read bandwidth probe (best of {a.rounds}): {bw / 1e9:.1f} GB/s\n")
    print("| op | shape | us per call | GB/s of stored bytes | / probe |\n|---|---|---:|---:|---:|")
    for c, v in times.items():
        med, size = statistics.median(v), cases[c][1]
        op, shape = c.split(" ", 1)
        print(f"| {op} | {shape} | {med * 1e6:.0f} | {size / med / 1e9:.2f} | {size / med / bw:.2f} |")


def dump(path: str) -> None:
    """Every quantized kernel's outputs on fixed random inputs, on each ISA this CPU runs."""
    out: dict[str, torch.Tensor] = {}
    for isa in ("avx512", "avx2", "generic"):
        if plugins.cpp_ops.cpu_isa(isa) != isa:
            continue
        gen = torch.Generator().manual_seed(1)
        for fmt in ("bf16", "int8", "fp8", "int4"):
            for n, k in ((67, 4096), (9, 1000), (130, 1408), (5, 200)):
                w, _ = _stored(fmt, n, k - k % GROUP if fmt == "int4" else k, gen)
                if fmt == "fp8":
                    w[0].view(torch.uint8)[3, 17] = 0x7F  # a NaN byte: row 3's outputs are NaN
                for m in (1, 2, 3, 5):
                    x = torch.randn(m, w[0].shape[1] * (2 if fmt == "int4" else 1), generator=gen)
                    out[f"{isa} linear_{fmt} {n}x{k} m{m}"] = _linear(fmt)(x, w)
            if fmt != "bf16":
                ws, _ = _experts(fmt, 4, 256, 192, gen)
                for t in (1, 3):
                    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(t)])
                    x, tw = torch.randn(t, 256, generator=gen), torch.rand(t, 2, generator=gen)
                    out[f"{isa} moe_experts_{fmt} t{t}"] = _moe(fmt)(x, ids, tw, ws)
    plugins.cpp_ops.cpu_isa("best")
    torch.save(out, path)
    print(f"{len(out)} outputs ({sum(v.numel() for v in out.values())} values) -> {path}")


def compare(old: str, new: str) -> None:
    a, b = torch.load(old), torch.load(new)
    differ = [c for c in a if c not in b or not torch.equal(a[c].view(torch.int32), b[c].view(torch.int32))]
    values = sum(v.numel() for v in a.values())
    print(f"{len(a)} outputs, {values} values: " + ("bit for bit equal" if not differ else f"{len(differ)} differ:"))
    for c in differ:
        print("  ", c)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--isa", choices=["avx512", "avx2", "best"], default="best")
    p.add_argument("--formats", nargs="+", default=["int8", "fp8", "int4", "bf16"])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--no-moe", dest="moe", action="store_false", help="leave out the routed experts")
    p.add_argument("--cold-bytes", type=int, default=384 << 20, help="distinct weight bytes per case")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--dump", metavar="PATH", help="write the kernels' outputs on fixed inputs instead")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two --dump files bit for bit")
    a = p.parse_args(argv)
    if a.compare:
        compare(*a.compare)
    elif a.dump:
        dump(a.dump)
    else:
        bench(a)


if __name__ == "__main__":
    main()
