"""Cost of rolling a Gated DeltaNet layer's recurrent state back to the accepted row: two designs, one run.

    python -m runtime.bench.gdn_rollback [--reps 15] [--batch 4] [--output bench_results/gdn_rollback.json]

One GDN layer at Qwen3-Next-80B's dims (Hk 16 x Dk 128, Hv 32 x Dv 128, conv kernel 4: 2 MiB of fp32 state per
request), R requests verifying 1+k rows each through `mtp::gdn_step`'s CPU computation on one layer's pools
(plugins/gdn_ops.py `gdn_step_tensors`, 1 thread):

  slots    per-position state slots (what runtime/core/state_pool.py does, vLLM's design): the verify forward stores the
           state after every row in the request's K+1 slots; rollback = choosing the slot of the accepted row
           (no extra work after the forward).
  replay   checkpoint + replay (ReplaySSM-like): the verify forward stores nothing (the checkpoint slot keeps the state
           before the step); after acceptance the a+1 accepted rows are replayed from the checkpoint (their inputs
           kept from the verify), storing the last row's state into the checkpoint slot.

Both give the same state (checked here, every rep). Timed per step for each accepted count a = 0..k, interleaved
(slots, replay, slots, ...), medians over reps. Measured on this 2-core shared CPU: the numbers rank the designs on
this op and machine; a GPU kernel has a different balance (state writes are memory traffic, replay is compute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from plugins.gdn_ops import gdn_step_tensors  # mtp::gdn_step's computation on one layer's pool tensors

HK, DK, HV, DV, KERNEL = 16, 128, 32, 128, 4  # Qwen3-Next-80B-A3B linear attention
C = 2 * HK * DK + HV * DV
I32 = torch.int32


def _ints(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=I32)


def run(batch: int, k: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w, a_log, dt = 0.3 * torch.randn(C, KERNEL, generator=g), 0.5 * torch.randn(HV, generator=g), torch.randn(HV)
    rows = 1 + k
    mixed, b, a = torch.randn(batch * rows, C, generator=g), torch.randn(batch * rows, HV), torch.randn(batch * rows, HV)
    slots = batch * rows
    conv0, ssm0 = 0.1 * torch.randn(slots, C, KERNEL - 1, generator=g), 0.01 * torch.randn(slots, HV, DK, DV)
    read = _ints([r * rows for r in range(batch)])  # each request's committed state: the first slot of its group
    starts = _ints([100] * batch)
    result: dict = {}
    for acc in range(k + 1):
        times: dict[str, list[float]] = {"verify_no_store": [], "slots": [], "replay": []}
        for _ in range(reps):
            # slots: store every row's state (row j -> the group's slot j+1, the last one wrapping onto the read slot)
            conv, ssm = conv0.clone(), ssm0.clone()
            writes = _ints([r * rows + (j + 1) % rows for r in range(batch) for j in range(rows)])
            t0 = time.perf_counter()
            gdn_step_tensors(mixed, b, a, _ints([rows] * batch), starts, read, writes, conv, ssm, w, a_log, dt,
                                   HK, DK, DV)  # fmt: skip
            times["slots"].append(time.perf_counter() - t0)
            chosen = [r * rows + (acc + 1) % rows for r in range(batch)]
            slot_state = ssm[chosen].clone()
            # replay: verify without stores, then replay the acc+1 accepted rows from the checkpoint (in place)
            conv, ssm = conv0.clone(), ssm0.clone()
            keep = torch.cat([torch.arange(r * rows, r * rows + acc + 1) for r in range(batch)])
            replay_writes = _ints(sum([[-1] * acc + [r * rows] for r in range(batch)], []))
            t0 = time.perf_counter()
            gdn_step_tensors(mixed, b, a, _ints([rows] * batch), starts, read, _ints([-1] * slots), conv, ssm,
                                   w, a_log, dt, HK, DK, DV)  # fmt: skip
            times["verify_no_store"].append(time.perf_counter() - t0)
            gdn_step_tensors(mixed[keep], b[keep], a[keep], _ints([acc + 1] * batch), starts, read, replay_writes,
                                   conv, ssm, w, a_log, dt, HK, DK, DV)  # fmt: skip
            times["replay"].append(time.perf_counter() - t0)  # verify without stores + the replay
            torch.testing.assert_close(ssm[read.long()], slot_state, atol=1e-5, rtol=1e-5)  # the same rolled-back state
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        # rollback cost = what each design adds to a verify forward that stores nothing
        result[str(acc)] = med | {"slots_rollback": med["slots"] - med["verify_no_store"],
                                  "replay_rollback": med["replay"] - med["verify_no_store"]}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = {"dims": {"Hk": HK, "Dk": DK, "Hv": HV, "Dv": DV, "kernel": KERNEL}, "batch": args.batch,
              "reps": args.reps, "ms_per_step_per_layer": {}}  # fmt: skip
    print(f"one GDN layer, {args.batch} requests, ms per verify step (median of {args.reps})")
    print("k  accepted  verify(no store)  slots  replay  | rollback cost: slots  replay")
    for k in (1, 2, 3):
        res = run(args.batch, k, args.reps)
        report["ms_per_step_per_layer"][str(k)] = res
        for acc, t in res.items():
            print(f"{k}  {acc:>8}  {t['verify_no_store']:16.2f}  {t['slots']:5.2f}  {t['replay']:6.2f}  |"
                  f"                {t['slots_rollback']:5.2f}  {t['replay_rollback']:6.2f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
