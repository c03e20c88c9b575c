"""`mtp::gdn_step`'s C++ CPU kernel against the vectorised torch form it replaced (`plugins.gdn_ops.gdn_step_tensors`,
still the rollback bench's path), same inputs, 1 thread, interleaved rounds, medians of process CPU time. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.plugins.bench_gdn_step --rounds 7

Cases: a small hybrid layer (Hk 4, Hv 8, Dk = Dv = 64) at 8 requests x 1 and x 4 rows, and Qwen3-Next's GDN head
sizes (Hk 16, Hv 32, Dk = Dv = 128) at 1 request x 1 and x 4 rows; every request continues from a stored slot and
every row is stored (a verify step's worst case: one state copy per row).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import plugins.gdn_ops as gdn_ops
from plugins.gdn_pool import GDNPoolGeometry, address, allocate_state

CASES = [(4, 8, 64, 8, 1), (4, 8, 64, 8, 4), (16, 32, 128, 1, 1), (16, 32, 128, 1, 4)]  # Hk, Hv, D, requests, rows


def time_case(hk: int, hv: int, d: int, reqs: int, rows: int, rounds: int, calls: int) -> dict[str, float]:
    """Median µs per call of each form on one case (the same inputs and pools)."""
    kk, t = 4, reqs * rows
    geom = GDNPoolGeometry(1, reqs * (rows + 2), 2 * hk * d + hv * d, kk, hk, hv, d, d)
    conv, ssm = allocate_state(geom)
    ssm.normal_(0, 0.1)
    g = torch.Generator().manual_seed(0)
    mixed, b, a = (torch.randn(t, n, generator=g) for n in (geom.conv_dim, hv, hv))
    w, a_log, dt = 0.3 * torch.randn(geom.conv_dim, kk, generator=g), torch.randn(hv), torch.randn(hv)
    meta = [torch.tensor(x, dtype=torch.int32) for x in ([rows] * reqs, [10] * reqs, range(reqs), range(reqs, reqs + t))]
    fns = {"cpp": lambda: torch.ops.mtp.gdn_step(mixed, b, a, *meta, address(conv), address(ssm), w, a_log, dt,
                                                 **geom.attrs(0)),
           "torch": lambda: gdn_ops.gdn_step_tensors(mixed, b, a, *meta, conv[0], ssm[0], w, a_log, dt, hk, d, d)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            t0 = time.process_time()
            for _ in range(calls):
                fns[name]()
            times[name].append((time.process_time() - t0) / calls * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| Hk / Hv / D | requests x rows | C++ us | torch form us | ratio |\n|---|---|---:|---:|---:|")
    for hk, hv, d, reqs, rows in CASES:
        m = time_case(hk, hv, d, reqs, rows, args.rounds, args.calls)
        print(f"| {hk} / {hv} / {d} | {reqs} x {rows} | {m['cpp']:.0f} | {m['torch']:.0f} | {m['torch'] / m['cpp']:.1f}x |")


if __name__ == "__main__":
    main()
