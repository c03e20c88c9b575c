"""Where one decode forward of a compiled hybrid MoE engine spends its time, piece by piece, against weight bytes.

    OMP_NUM_THREADS=1 python -m runtime.bench.decode_pieces --engine build/realsize/a3b-engine

The step of runtime.bench.compiled_profile (batch 1, one row after a `--context`-token prefill), `--iters` times under
torch.profiler; each op's self CPU time goes to a piece by its place in the layer, read off the ordered events: a layer
starts at its widest projection (GDN in_proj qkv / attention q_proj + gate), the mixer ends at its out_proj (the only
projection wider than hidden on its input), then the router, the routed experts and the shared expert. Per piece: ms per
forward, the weight bytes it reads and their rate (the routed experts: top-k of them). Inductor's own kernels (norms,
gates, residual adds) are no profiler op: the forward's process time minus the ops' total is their share.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from runtime.bench.compiled_compare import step_inputs
from runtime.executors.compiled_executor import CompiledExecutor


@dataclass
class LayerCursor:
    """Where the event stream is inside the current layer."""

    mixer_done: bool = False  # its out_proj has run: what follows is the MoE block
    experts_done: bool = False  # the routed experts have run: the shared expert's projections follow


def piece_of(op: str, weight: tuple[int, ...] | None, hidden: int, at: LayerCursor) -> str:
    """The piece an op call belongs to (advancing `at`); weight: linear_bf16's [out, in]."""
    if op == "mtp::linear_bf16" and weight is not None:
        out, inp = weight
        if out >= 4 * hidden and inp == hidden:  # a layer starts
            at.mixer_done = at.experts_done = False
            return "mixer: in_proj qkv (GDN) / q_proj + gate (attention)"
        if out == inp == hidden:
            return "lm_head"
        if inp > hidden:
            at.mixer_done = True
            return "mixer: out_proj (GDN) / o_proj (attention)"
        if at.experts_done or out == 1:
            return "moe: shared expert (gate, up, down, sigmoid gate)"
        if out < 64:
            return "moe: router" if at.mixer_done else "mixer: in_proj b, a (GDN)"
        return "mixer: in_proj z (GDN)" if out == 2 * hidden else "mixer: k_proj, v_proj (attention)"
    if op == "mtp::moe_experts":
        at.experts_done = True
        return "moe: routed experts (top-k)"
    if op == "mtp::gdn_step":
        return "mixer: mtp::gdn_step"
    if op in ("mtp::kv_write", "mtp::paged_attention"):
        return "mixer: kv_write + paged_attention"
    return "aten ops (copies, views, allocations)"


def profile_pieces(engine: Path, context: int, iters: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """(median forward CPU ms, {piece: self CPU ms per forward}, {piece: weight bytes per forward})."""
    ex = CompiledExecutor(engine)
    cfg, m = ex.config, ex.config.model
    prefills, step, _ = step_inputs(1, 1, context, cfg.kv.block_size, cfg.kv.table_width, m.vocab_size,
                                    ex.state is not None)  # fmt: skip
    for p in prefills:
        ex.run_main(p)
    for _ in range(3):  # warm-up
        ex.run_main(step)
    times = []
    for _ in range(iters):
        t0 = time.process_time()
        ex.run_main(step)
        times.append(time.process_time() - t0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(iters):
            ex.run_main(step)
    ms: dict[str, float] = defaultdict(float)
    nbytes: dict[str, float] = defaultdict(float)
    expert_bytes = m.num_experts_per_tok * 3 * m.hidden_size * m.moe_intermediate_size * 2  # bf16 gate, up, down
    at = LayerCursor()
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        weight = tuple(e.input_shapes[1]) if e.name == "mtp::linear_bf16" else None
        piece = piece_of(e.name, weight, m.hidden_size, at)
        ms[piece] += e.self_cpu_time_total / 1e3 / iters
        if weight is not None:
            nbytes[piece] += weight[0] * weight[1] * 2 / iters
        elif e.name == "mtp::moe_experts":
            nbytes[piece] += expert_bytes / iters
    return statistics.median(times) * 1e3, dict(ms), dict(nbytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True, help="a bf16 engine built with mtp-build --compile aoti")
    p.add_argument("--context", type=int, default=90)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    forward, ms, nbytes = profile_pieces(args.engine, args.context, args.iters)
    print(f"forward {forward:.2f} ms (process time, median of {args.iters}); the ops' self time {sum(ms.values()):.2f}")
    print("| piece | ms | weight MB | GB/s |\n|---|---:|---:|---:|")
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        b = nbytes.get(k, 0.0)
        print(f"| {k} | {v:.2f} | {b / 1e6:.1f} | " + (f"{b / 1e6 / v:.1f} |" if b else "- |"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
