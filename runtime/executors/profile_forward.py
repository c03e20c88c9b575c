"""Per-forward time of the torch executor against the physical bound (weight bytes read / 25 GB/s).

    python -m runtime.executors.profile_forward --layers 12 --threads 1
    python -m runtime.executors.profile_forward --checkpoint models/tiny

Builds a random deep model at the width of models/tiny (override with --layers/--hidden ...), prefills
`--context` tokens per request, then times `run_main` (the verify forward: every row's hidden and
logits) for each (batch, rows per request) and one draft depth, median of `--iters`: wall ms and
this thread's CPU ms (on a shared machine wall time mostly measures the other tenants). The bound counts
the bytes of every weight a forward must read: all dense weights, the embedding rows it looks up and
the routed experts its tokens actually select (counted with a hook on the router). `--profile` prints
the torch.profiler op table of the first shape instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from models.feed_forward import MoE
from models.testing import random_model, tiny_config
from runtime.executors.base import DraftInput, MainInput
from runtime.executors.torch_executor import TorchExecutor

BANDWIDTH = 25e9  # B/s: one core's sustained read bandwidth on the machines we bench on
PEAK_FLOPS = 1e11  # fp32 FLOP/s of one core's GEMMs (measured ~86e9 on a 32-row MLP on the 2-core dev VM)


def deep_config(layers: int, hidden: int = 256, experts: int = 8, vocab: int = 2048):
    """models/tiny's width (hidden 256, 8 heads / 2 KV heads of 32, 8 experts top-2) at `layers` depth."""
    return tiny_config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8, moe_intermediate_size=hidden // 4,
        n_routed_experts=experts, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.0,
        max_position_embeddings=4096,
    )  # fmt: skip


class ExpertCounter:
    """Counts routed experts selected per MoE layer in a forward (their weights are what it reads)."""

    def __init__(self, model) -> None:
        self.touched = 0
        self.handles = [m.gate.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, MoE)]

    def _hook(self, _mod, _inp, out) -> None:
        self.touched += int(torch.unique(out[0]).numel())

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def bound_ms(model, rows: int, touched_experts: int, main: bool = True) -> float:
    """Weight bytes one forward reads / BANDWIDTH, in ms (a draft depth reads the MTP module, not the layers)."""
    expert_names = ("w_gate_up", "w_down")
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if not n.endswith(expert_names) and not n.startswith(("embed_tokens", "mtp." if main else "layers.")))  # fmt: skip
    moe = next((m for m in model.modules() if isinstance(m, MoE)), None)
    per_expert = 0 if moe is None else (moe.w_gate_up[0].numel() + moe.w_down[0].numel()) * moe.w_down.element_size()
    emb = rows * model.embed_tokens.weight.shape[1] * model.embed_tokens.weight.element_size()
    return (dense + emb + touched_experts * per_expert) / BANDWIDTH * 1e3


def compute_ms(model, rows: int) -> float:
    """The main forward's GEMM FLOPs (each weight used once per row; each row's top-k experts) / PEAK_FLOPS.

    At a few rows the byte bound dominates; from ~16 rows this one does (one core, fp32).
    """
    skip = ("embed_tokens", "mtp.")
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(("w_gate_up", "w_down"))
                and not n.startswith(skip))  # fmt: skip
    moes = [m for n, m in model.named_modules() if isinstance(m, MoE) and not n.startswith("mtp.")]
    experts = sum(rows * m.gate.top_k * (m.w_gate_up[0].numel() + m.w_down[0].numel()) for m in moes)
    return 2 * (rows * dense + experts) / PEAK_FLOPS * 1e3


def _tables(batch: int, blocks_per_req: int) -> np.ndarray:
    return (1 + np.arange(batch * blocks_per_req, dtype=np.int32)).reshape(batch, blocks_per_req)


def main_input(batch: int, rows: int, start: int, tables: np.ndarray, vocab: int, rng) -> MainInput:
    t = batch * rows
    return MainInput(
        input_ids=rng.integers(0, vocab, t).astype(np.int64),
        positions=np.tile(np.arange(start, start + rows, dtype=np.int64), batch),
        q_counts=np.full(batch, rows, dtype=np.int32),
        kv_lens=np.full(batch, start + rows, dtype=np.int32),
        block_tables=tables,
        logit_rows=np.arange(t, dtype=np.int64),
    )


def time_shape(ex: TorchExecutor, batch: int, rows: int, context: int, iters: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cfg = ex.model.cfg
    block = ex.geom.block_size
    tables = _tables(batch, (context + rows + block) // block + 1)
    ex.run_main(main_input(batch, context, 0, tables, cfg.vocab_size, rng))  # prefill
    counter = ExpertCounter(ex.model)
    inp = main_input(batch, rows, context, tables, cfg.vocab_size, rng)
    ex.run_main(inp)
    touched, counter.touched = counter.touched, 0
    times, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        ex.run_main(inp)  # rewrites the same positions: a verify step that accepted nothing
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    counter.touched = 0
    draft = DraftInput(np.zeros((batch, cfg.hidden_size), np.float32), inp.input_ids[:batch].copy(),
                       np.full(batch, context, np.int64), np.ones(batch, np.int32), tables)  # fmt: skip
    ex.run_draft(draft)
    d_touched, counter.touched = counter.touched, 0
    d_times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        ex.run_draft(draft)
        d_times.append(time.perf_counter() - t0)
    counter.close()
    main_ms, draft_ms = statistics.median(times) * 1e3, statistics.median(d_times) * 1e3
    b_main, b_draft = bound_ms(ex.model, batch * rows, touched), bound_ms(ex.model, batch, d_touched, main=False)
    return {"batch": batch, "rows": rows, "main_ms": main_ms, "main_cpu_ms": statistics.median(cpu) * 1e3, "bound_ms": b_main, "x_bound": main_ms / b_main,
            "compute_ms": compute_ms(ex.model, batch * rows),
            "draft_ms": draft_ms, "draft_bound_ms": b_draft, "draft_x_bound": draft_ms / b_draft}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="time this checkpoint (e.g. models/tiny) instead of a random model")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--context", type=int, default=64, help="tokens prefilled per request before timing")
    ap.add_argument("--shapes", default="1x1,1x4,8x1,8x4", help="batch x rows-per-request, comma separated")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="print the torch.profiler op table of the first shape")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.checkpoint:
        from models.checkpoint import load_model

        model = load_model(args.checkpoint)[0]
    else:
        model = random_model(deep_config(args.layers, args.hidden))
    ex = TorchExecutor(model, num_blocks=512, block_size=16)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.profile:
        b, r = shapes[0]
        time_shape(ex, b, r, args.context, 3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            time_shape(ex, b, r, args.context, args.iters)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    cfg = model.cfg
    print(f"{args.checkpoint or 'random'}: layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} threads={torch.get_num_threads()} context={args.context} "
          f"bound at {BANDWIDTH / 1e9:.0f} GB/s")  # fmt: skip
    print(f"{'batch':>5} {'rows':>4} {'main ms':>8} {'cpu ms':>7} {'bound':>7} {'x':>5} {'cpu x':>5} {'flops':>6} | "
          f"{'draft ms':>8} {'bound':>7} {'x':>5}")  # fmt: skip
    for b, r in shapes:
        s = time_shape(ex, b, r, args.context, args.iters)
        print(f"{b:>5} {r:>4} {s['main_ms']:>8.3f} {s['main_cpu_ms']:>7.3f} {s['bound_ms']:>7.3f} {s['x_bound']:>5.1f} {s['main_cpu_ms'] / s['bound_ms']:>5.1f} "
              f"{s['compute_ms']:>6.3f} | "
              f"{s['draft_ms']:>8.3f} {s['draft_bound_ms']:>7.3f} {s['draft_x_bound']:>5.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
