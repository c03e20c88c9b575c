"""The draft loop in one call, measured (issue 27): K compiled draft calls against one fused K-depth package.

    python -m runtime.bench.fused_draft --checkpoint models/deep --engine engines/deep-aoti --k 3 --batches 1 8 \
        --rounds 15

The engine must be built with `--compile aoti --num-draft-tokens K` (without --engine one is built under a temporary
directory). The bench compiles builder/fused_draft.py's module for k = 1..K, and mtp_draft once more for its compile
time under the same load, through the builder's own `compile_graph` (same export dims, weight storage, inductor
options) into a temporary directory, then on identical inputs (a pool filled with random history, R requests at
about `--context` tokens, random main hiddens and tokens, greedy) times per step:
  unfused   runtime/core/draft_loop.run as the engine runs it: k calls of the engine's mtp_draft package through the
            compiled executor, one batched host argmax between depths
  fused     one call of the fused package through the same ExecutionContext glue, its drafts appended as the loop does
  verify    for scale: the K=k step's verify forward (run_main, 1+k rows per request) on the same requests
Before timing, both forms run once from the same pool: the drafts must be identical and the pools (the MTP plane's
writes) equal. Rounds alternate the order of the forms; a form's time per round is the median of `--iters` steps, in
CPU time of this thread and in wall time; the table shows the medians over rounds and the median per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builder.compile_aoti import compile_graph, model_weights
from builder.fused_draft import export_fused
from models.checkpoint import load_model
from models.engine_format.compiled import load_package
from models.engine_format.graph_io import DRAFT_GRAPH, graph_spec
from runtime.core import draft_loop
from runtime.core.mtp_plan import RequestUpdate, plan_draft
from runtime.core.request import Request
from runtime.core.sampling import SamplingParams
from runtime.executors.base import MainInput, draft_module
from runtime.executors.compiled_executor import CompiledExecutor, ExecutionContext


def compile_fused(ex: CompiledExecutor, checkpoint: str, k_max: int, out: Path) -> tuple[dict[int, Path], dict]:
    """Packages of the fused module for k = 1..k_max (and mtp_draft twice, for its compile time); {k: path}, seconds."""
    cfg = ex.config
    model = load_model(checkpoint, getattr(torch, cfg.dtype))[0]
    geom, width, weights = ex.geom, cfg.kv.table_width, model_weights(model)
    paths, seconds = {}, {}
    for label in ("mtp_draft_first", DRAFT_GRAPH):  # the first compile of a process also pays Inductor's warm-up
        t0 = time.perf_counter()
        compile_graph(DRAFT_GRAPH, model, geom, width, out / f"{label}.pt2", weights)
        seconds[label] = round(time.perf_counter() - t0, 1)
    for k in range(1, k_max + 1):
        modules = [draft_module(d, ex.num_draft_graphs, ex.mtp_modules) for d in range(k)]
        paths[k] = out / f"fused{k}.pt2"
        t0 = time.perf_counter()
        compile_graph(f"fused{k}", model, geom, width, paths[k], weights,
                      export=partial(export_fused, model, geom, width, modules))  # fmt: skip
        seconds[f"fused{k}"] = round(time.perf_counter() - t0, 1)
    return paths, seconds


def fused_context(ex: CompiledExecutor, path: Path) -> ExecutionContext:
    """The fused package behind the executor's own call glue, with mtp_draft's buffers (its inputs are mtp_draft's)."""
    spec, lim = graph_spec(DRAFT_GRAPH), ex.config.limits
    rows = {"requests": lim.max_batch, "max_blocks": ex.config.kv.table_width, "H": ex.hidden_size}
    buffers = {n: torch.zeros(int(np.prod([rows[d] if isinstance(d, str) else d for d in spec.dims[n]])),
                              dtype=getattr(torch, spec.dtypes[n])) for n in spec.step_inputs}  # fmt: skip
    run = load_package(ex.config, path).loader.boxed_run
    arrays = {n: b.numpy() for n, b in buffers.items()}
    return ExecutionContext(spec, run, buffers, arrays, list(ex.contexts[DRAFT_GRAPH].pool_ptrs))


class Batch:
    """R greedy requests, each at its own base position near `context`, with their own blocks of the pool."""

    def __init__(self, ex: CompiledExecutor, r: int, context: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        cfg = ex.config
        bs, width = cfg.kv.block_size, cfg.kv.table_width
        self.bases = [context + 5 * i for i in range(r)]
        self.tables = np.full((r, width), -1, dtype=np.int32)
        nxt = 1  # block 0 is the null block
        for i, b in enumerate(self.bases):
            n = -(-(b + cfg.num_draft_tokens + 1) // bs)
            self.tables[i, :n] = np.arange(nxt, nxt + n)
            nxt += n
        vocab = ex.vocab_size
        self.prompts = [rng.integers(0, vocab, b + 1).tolist() for b in self.bases]  # token b is the base token
        self.hidden = rng.standard_normal((r, ex.hidden_size)).astype(np.float32)  # h_{base-1} per request
        self.updates = [RequestUpdate(b, [], 0, None, i) for i, b in enumerate(self.bases)]

    def requests(self) -> list[Request]:
        return [Request(f"r{i}", p, SamplingParams(), i, np.random.default_rng(i)) for i, p in enumerate(self.prompts)]

    def verify(self, k: int) -> MainInput:
        """The step's verify forward: 1+k rows per request from its base (the real one's shape; tokens random)."""
        rows = 1 + k
        pos = np.concatenate([np.arange(b, b + rows) for b in self.bases])
        return MainInput(np.concatenate([p[-1:] * rows for p in self.prompts]).astype(np.int64), pos.astype(np.int64),
                         np.full(len(self.bases), rows, np.int32), np.array([b + rows for b in self.bases], np.int32),
                         self.tables, np.arange(len(pos), dtype=np.int64))  # fmt: skip


def unfused_step(ex: CompiledExecutor, batch: Batch, reqs: list[Request], k: int) -> None:
    failed = draft_loop.run(ex.run_draft, lambda: None, reqs, batch.updates, batch.hidden, batch.tables,
                            [k] * len(reqs), k)  # fmt: skip
    assert not failed, failed


def fused_step(ctx: ExecutionContext, batch: Batch, reqs: list[Request]) -> None:
    """What a fused draft loop would do for greedy requests: one call, every row's k drafts appended."""
    hidden = batch.hidden[[u.draft_row for u in batch.updates]]
    tokens = [r.token_ids[-1] for r in reqs]
    drafts = ctx(plan_draft(hidden, tokens, [u.num_computed for u in batch.updates], 0, batch.tables))[0]
    for r, row in zip(reqs, drafts.tolist(), strict=True):
        r.spec.drafts.extend(row)


def check(ex, ctx, batch, k, initial) -> dict[str, Any]:
    """Both forms from the same pool: identical drafts, and the pools they leave (the MTP plane's writes)."""
    pools, drafts = [], []
    for form in ("unfused", "fused"):
        ex.pool.copy_(initial)
        reqs = batch.requests()
        if form == "unfused":
            unfused_step(ex, batch, reqs, k)
        else:
            fused_step(ctx, batch, reqs)
        drafts.append([r.spec.drafts for r in reqs])
        pools.append(ex.pool.clone())
    if drafts[0] != drafts[1]:
        raise SystemExit(f"k={k} R={len(batch.bases)}: the fused drafts {drafts[1]} differ from K calls' {drafts[0]}")
    diff = float((pools[0] - pools[1]).abs().max())
    if diff > 1e-5:
        raise SystemExit(f"k={k} R={len(batch.bases)}: the fused KV writes differ from K calls' (max |diff| {diff})")
    changed = int((pools[0] != initial).flatten(3).any(-1).sum())  # (plane, k/v, block) slices written: not 0
    return {"drafts_equal": True, "pool_bit_equal": bool(torch.equal(*pools)), "pool_max_diff": diff,
            "written_slices": changed}  # fmt: skip


def timed(fn, iters: int) -> tuple[float, float]:
    """Median (CPU, wall) seconds per call of fn() over `iters` calls."""
    cpu, wall = [], []
    for _ in range(iters):
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def bench(ex, ctxs, batches, ks, rounds: int, iters: int) -> list[dict[str, Any]]:
    """Interleaved: every round times every (batch, k) form once, the forms' order alternating round by round."""
    samples: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
    for rnd in range(rounds):
        for r, batch in batches.items():
            reqs = batch.requests()
            for k in ks:
                verify = batch.verify(k)  # built once: the forms' own input building is what they time
                forms = {"unfused": partial(unfused_step, ex, batch, reqs, k),
                         "fused": partial(fused_step, ctxs[k], batch, reqs),
                         "verify": partial(ex.run_main, verify)}  # fmt: skip
                order = list(forms) if rnd % 2 == 0 else list(reversed(forms))
                for form in order:
                    for req in reqs:
                        req.spec.drafts.clear()
                    samples.setdefault((r, k, form), []).append(timed(forms[form], iters))
    rows = []
    for r in batches:
        for k in ks:
            u, f, v = (samples[(r, k, form)] for form in ("unfused", "fused", "verify"))
            row: dict[str, Any] = {"batch": r, "k": k}
            for clock, i in (("cpu", 0), ("wall", 1)):
                row[f"unfused_{clock}_ms"] = 1e3 * statistics.median(s[i] for s in u)
                row[f"fused_{clock}_ms"] = 1e3 * statistics.median(s[i] for s in f)
                row[f"verify_{clock}_ms"] = 1e3 * statistics.median(s[i] for s in v)
                row[f"fused_over_unfused_{clock}"] = statistics.median(b[i] / a[i] for a, b in zip(u, f, strict=True))
                row[f"saved_{clock}_us"] = 1e3 * (row[f"unfused_{clock}_ms"] - row[f"fused_{clock}_ms"])
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| batch | k | unfused ms CPU (wall) | fused ms CPU (wall) | fused / unfused CPU (wall) | saved us CPU | "
           "verify ms CPU | saved / (verify + unfused) CPU |", "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for w in rows:
        step = w["verify_cpu_ms"] + w["unfused_cpu_ms"]  # the step's two forwards; commit and host work not counted
        out.append(f"| {w['batch']} | {w['k']} | {w['unfused_cpu_ms']:.3f} ({w['unfused_wall_ms']:.3f}) | "
                   f"{w['fused_cpu_ms']:.3f} ({w['fused_wall_ms']:.3f}) | {w['fused_over_unfused_cpu']:.3f} "
                   f"({w['fused_over_unfused_wall']:.3f}) | {w['saved_cpu_us']:.0f} | {w['verify_cpu_ms']:.3f} | "
                   f"{w['saved_cpu_us'] / 10 / step:.1f}% |")  # fmt: skip
    return "\n".join(out)


def build_engine(checkpoint: str, k: int, out: Path) -> Path:
    cmd = [sys.executable, "-m", "builder.cli", "--checkpoint", checkpoint, "--output", str(out), "--compile", "aoti",
           "--num-draft-tokens", str(k)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--engine", type=Path, help="a --compile aoti engine of the checkpoint (read only); default: build")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=200, help="base position of the first request")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path, default=Path("bench_results/fused_draft.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fused_draft_") as tmp:
        engine = args.engine or build_engine(args.checkpoint, args.k, Path(tmp) / "engine")
        ex = CompiledExecutor(engine)
        if ex.config.num_draft_tokens < args.k:
            raise SystemExit(f"{engine} was built for K <= {ex.config.num_draft_tokens}; --k {args.k}")
        paths, seconds = compile_fused(ex, args.checkpoint, args.k, Path(tmp))
        ctxs = {k: fused_context(ex, path) for k, path in paths.items()}
    ks = list(range(1, args.k + 1))
    ex.pool.normal_(generator=torch.Generator().manual_seed(0))  # the history every depth attends to
    initial = ex.pool.clone()
    batches = {r: Batch(ex, r, args.context, seed=r) for r in args.batches}
    checks = {f"R{r} k{k}": check(ex, ctxs[k], b, k, initial) for r, b in batches.items() for k in ks}
    with torch.inference_mode():
        rows = bench(ex, ctxs, batches, ks, args.rounds, args.iters)
    load = os.getloadavg()
    print(table(rows))
    print(f"compile seconds: {seconds}; checks: {checks}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                     "compile_seconds": seconds, "checks": checks, "load_average": load,
                                     "threads": torch.get_num_threads()}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
