"""Prompt tokens/s of one Gated DeltaNet layer's `mtp::gdn_step` (the C++ CPU op): chunked form vs row by row.

    python -m runtime.bench.gdn_prefill [--tokens 2000] [--reps 5] [--threads 1] [--dims 16,128,32,128]

One fresh prompt of N tokens through one GDN layer (Qwen3-Next-80B's dims by default: Hk 16 x Dk 128, Hv 32 x Dv 128,
conv kernel 4), its state stored after the last row, as the engine's prefill chunk does. The op runs twice per rep,
interleaved: chunked (plugins/csrc/gdn_chunk.h, the default for runs of >= `gdn_chunk_min_run()` rows) and row by row
(the minimum run set out of reach); medians over reps. Both outputs are checked equal within fp32 tolerance every rep.
Several --tokens values (e.g. 8,16,32,64) show where the chunked form starts to pay (the minimum run length).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import plugins.gdn_ops  # noqa: F401  (torch.ops.mtp.gdn_step)
from plugins.cpp_ops import gdn_chunk_min_run
from plugins.gdn_pool import GDNPoolGeometry, address

I32 = torch.int32
ROW_BY_ROW = 1 << 30  # a minimum run no prompt reaches


def _run(dims: tuple[int, int, int, int], n: int, reps: int) -> tuple[float, float]:
    """Median seconds of (chunked, row by row) for one n-token prompt."""
    hk, dk, hv, dv = dims
    c, kernel = 2 * hk * dk + hv * dv, 4
    g = torch.Generator().manual_seed(0)
    mixed, b, a = torch.randn(n, c, generator=g), torch.randn(n, hv, generator=g), torch.randn(n, hv, generator=g)
    w, a_log, dt = 0.3 * torch.randn(c, kernel, generator=g), torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    geom = GDNPoolGeometry(1, 2, c, kernel, hk, hv, dk, dv)
    conv, ssm = torch.zeros(2, c, kernel - 1), torch.zeros(2, hv, dk, dv)
    meta = [torch.tensor(x, dtype=I32) for x in ([n], [0], [0], [-1] * (n - 1) + [1])]

    def once(min_run: int) -> tuple[float, torch.Tensor]:
        gdn_chunk_min_run(min_run)
        t0 = time.perf_counter()
        out = torch.ops.mtp.gdn_step(mixed, b, a, *meta, address(conv), address(ssm), w, a_log, dt, **geom.attrs(0))
        return time.perf_counter() - t0, out

    default = gdn_chunk_min_run()
    chunked, rows = [], []
    try:
        for _ in range(reps):
            tc, oc = once(1)
            tr, orow = once(ROW_BY_ROW)
            torch.testing.assert_close(oc, orow, atol=1e-4, rtol=1e-4)
            chunked.append(tc)
            rows.append(tr)
    finally:
        gdn_chunk_min_run(default)
    return statistics.median(chunked), statistics.median(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2000", help="prompt lengths, comma-separated (default 2000)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dims", default="16,128,32,128", help="Hk,Dk,Hv,Dv (default Qwen3-Next-80B's)")
    args = p.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",")]
        hk, dk, hv, dv = (int(x) for x in args.dims.split(","))
    except ValueError:
        p.error(f"--tokens {args.tokens!r} / --dims {args.dims!r}: comma-separated integers (e.g. 2000 / 16,128,32,128)")
    if min(tokens) < 1 or args.reps < 1 or args.threads < 1 or min(hk, dk, hv, dv) < 1 or hv % hk:
        p.error("--tokens, --reps, --threads and --dims must be >= 1, Hv a multiple of Hk")
    torch.set_num_threads(args.threads)
    print(f"gdn_step prefill, one layer, Hk {hk} x Dk {dk}, Hv {hv} x Dv {dv}, {args.threads} thread(s), "
          f"median of {args.reps} interleaved reps (default minimum chunked run {gdn_chunk_min_run()} rows)")
    print(f"{'tokens':>7} {'chunked tok/s':>14} {'row-by-row tok/s':>17} {'speed-up':>9}")
    for n in tokens:
        tc, tr = _run((hk, dk, hv, dv), n, args.reps)
        print(f"{n:>7} {n / tc:>14.0f} {n / tr:>17.0f} {tr / tc:>8.2f}x")


if __name__ == "__main__":
    main()
