"""mtp::linear_bf16 against torch's fp32 linears, cold weights, 1 thread, interleaved rounds, medians of process CPU time.

    OMP_NUM_THREADS=1 python -m runtime.bench.linear_bf16 --rows 1 2 4 8 32 --rounds 7

Each candidate multiplies x [M, K] by `--count` distinct weights of [N, K] in turn (together far larger than the
last-level cache, so every weight comes from DRAM, as in a decode step of a large model):
  bf16-op     torch.ops.mtp.linear_bf16 on the bf16 weights (what the compiled engine calls; on a CPU with AMX-BF16
              its exact AMX path from plugins.cpp_ops.amx_min_rows() rows, or from `--amx-min-rows`)
  bf16-op-noamx  (a CPU with AMX) the same op with its AMX path off: the register tiles, MKL from 16 rows
  fp32        F.linear on fp32 weights stored [N, K]
  fp32-in-out F.linear on fp32 weights stored [K, N] (models/feed_forward.py store_in_out: the eager layout)
  upcast+mm   F.linear(x, w.float()) on the bf16 weights (what the compiled engine generated before the op)
  int8-op     (--quantized) torch.ops.mtp.linear_int8 on the same weights quantized per output channel
  int4-gG     (--quantized) torch.ops.mtp.linear_int4 with group G, for each G of --int4-groups (default 32 64 128)
Rounds rotate the order; a candidate's round time is the median over `--iters` passes over all weights. Prints
per-matrix microseconds, the weight read rate (GB/s of the bytes each candidate stores) and the ratio to fp32.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import plugins.cpp_ops  # noqa: F401  (torch.ops.mtp.linear_bf16)
from plugins.reference import quantize_int4, quantize_int8


def _int4(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], group: int) -> torch.Tensor:
    return torch.ops.mtp.linear_int4(x, *w, group, None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--count", type=int, default=6, help="distinct weights (6 x 4096 x 4096 = 200 MB bf16)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--quantized", action="store_true", help="also the int8 and int4 ops (mtp-build --quantize)")
    p.add_argument("--int4-groups", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--isa", default="best", choices=["best", "avx512", "avx2", "generic"],
                   help="the kernels' body (an AVX-512 machine runs the AVX2 one too)")  # fmt: skip
    p.add_argument("--amx-min-rows", type=int, default=-1, help="bf16-op's AMX row threshold (default: the library's)")
    a = p.parse_args(argv)
    plugins.cpp_ops.cpu_isa(a.isa)
    amx_on = plugins.cpp_ops.amx_min_rows(a.amx_min_rows)
    torch.manual_seed(0)
    low = [torch.randn(a.n, a.k).bfloat16() for _ in range(a.count)]
    full = [w.float() for w in low]
    in_out = [w.t().contiguous().t() for w in full]
    cands: dict[str, tuple[list[Any], Callable[[torch.Tensor, Any], torch.Tensor]]] = {
        "bf16-op": (low, lambda x, w: torch.ops.mtp.linear_bf16(x, w, None)),
        "fp32": (full, lambda x, w: F.linear(x, w)),
        "fp32-in-out": (in_out, lambda x, w: F.linear(x, w)),
        "upcast+mm": (low, lambda x, w: F.linear(x, w.float())),
    }
    if amx_on:
        cands["bf16-op-noamx"] = cands["bf16-op"]
    amx = {"bf16-op-noamx": 1 << 30}  # each candidate's AMX threshold, set for its whole pass
    if a.quantized:  # a weight is a tuple (stored tensors...); its bytes are theirs together
        cands["int8-op"] = ([quantize_int8(w) for w in full], lambda x, w: torch.ops.mtp.linear_int8(x, *w, None))
        for g in a.int4_groups:
            cands[f"int4-g{g}"] = ([quantize_int4(w, g) for w in full], functools.partial(_int4, group=g))
    print(f"N={a.n} K={a.k}, {a.count} weights, isa {plugins.cpp_ops.cpu_isa()}, threads {torch.get_num_threads()}")
    print("| M | " + " | ".join(f"{c} us (GB/s)" for c in cands) + " | bf16-op / fp32 |")
    print("|---:|" + "---:|" * (len(cands) + 1))
    for m in a.rows:
        x = torch.randn(m, a.k)
        times: dict[str, list[float]] = {c: [] for c in cands}
        names = list(cands)
        for r in range(a.rounds):
            for c in names[r % len(names) :] + names[: r % len(names)]:
                weights, fn = cands[c]
                if amx_on:
                    plugins.cpp_ops.amx_min_rows(amx.get(c, amx_on))
                per = []
                for _ in range(a.iters):
                    t0 = time.process_time()
                    for w in weights:
                        fn(x, w)
                    per.append((time.process_time() - t0) / len(weights))
                times[c].append(statistics.median(per))
        med = {c: statistics.median(v) for c, v in times.items()}
        cells = []
        for c, (weights, _) in cands.items():
            stored = weights[0] if isinstance(weights[0], tuple) else (weights[0],)
            gbs = sum(t.numel() * t.element_size() for t in stored) / med[c] / 1e9
            cells.append(f"{med[c] * 1e6:.0f} ({gbs:.1f})")
        print(f"| {m} | " + " | ".join(cells) + f" | {med['bf16-op'] / med['fp32']:.2f} |")


if __name__ == "__main__":
    main()
