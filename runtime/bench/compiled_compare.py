"""Which compiled-step technology: one main forward per candidate, interleaved rounds, 1 thread, medians.

    python -m runtime.bench.compiled_compare --checkpoint models/deep --engine engines/bench-deep --rounds 15

The engine must be built with `mtp-build --compile aoti`. Every candidate runs the same verify forward
(`run_main`: `rows` rows per request at a context of `--context` tokens, every row's hidden and logits) over its
own pool, prefilled identically, and must return the same greedy tokens as the torch executor:
  torch          the eager torch executor (the reference)
  onnxruntime    the engine's ONNX graphs in ONNX Runtime
  aoti           the engine's AOTInductor packages (bf16-exact weights stored bf16, fp32 math)
  aoti-fp32      the same packages compiled with fp32 weights and freezing (MKL-prepacked GEMMs)
  compile        torch.compile(cpp_wrapper) of the same graph wrapper, fp32 weights, specialized to each shape
                 (dynamic=True took over 10 minutes to compile on the loaded 2-core machine)
Rounds rotate the candidate order; a candidate's time per round is the median of `--iters` calls, in CPU time
of this process (`CLOCK`). Prints one table (median and best ms per step, ratio to torch in the same rounds);
`--json` writes it too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.checkpoint import load_model
from models.engine_format import load_engine_config
from models.engine_format.compiled import AOTI_KIND
from runtime.executors.base import HybridMainInput, MainInput, MainOutput
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.executors.ort_executor import OrtExecutor
from runtime.executors.torch_executor import TorchExecutor

# CPU time of this process (every candidate runs on this thread with 1 thread): on the shared 2-core machine
# wall time mostly measures the other tenants (load average 7-15 during these runs).
CLOCK = time.process_time


def step_inputs(batch: int, rows: int, context: int, block: int, width: int, vocab: int, hybrid: bool = False):
    """A prefill of `context` tokens per request, then the timed verify step of `rows` rows per request.

    hybrid: HybridMainInput, request r owning state slots r*(rows+2) onwards: its prefill starts fresh (position 0: the
    slot it names is not read) and leaves its state in the group's first slot, which the step reads; the step's rows
    write the slots after it (never the one read, as runtime/core/state_pool.py plans them), so repeating the step
    repeats the same work."""
    g = np.random.default_rng(0)
    blocks_per = -(-(context + rows) // block)
    tables = np.full((batch, width), -1, np.int32)
    for r in range(batch):
        tables[r, :blocks_per] = 1 + r * blocks_per + np.arange(blocks_per)
    ids = g.integers(0, vocab, (batch, context + rows))

    def main(lo: int, hi: int, reqs: list[int]) -> MainInput:
        n, r = hi - lo, len(reqs)
        inp = (ids[reqs, lo:hi].reshape(-1), np.tile(np.arange(lo, hi), r), np.full(r, n, np.int32),
               np.full(r, hi, np.int32), tables[reqs], np.arange(r * n))  # fmt: skip
        if not hybrid:
            return MainInput(*inp)
        base = np.array(reqs, np.int32) * (rows + 2)
        if lo == 0:  # the prefill: fresh state, its last row into the group's first slot
            read, write = base + rows + 1, np.full((r, n), -1, np.int32)
            write[:, -1] = base
        else:
            read, write = base, base[:, None] + 1 + np.arange(n, dtype=np.int32)
        return HybridMainInput(*inp, read, write.reshape(-1))

    prefills = [main(0, context, [r]) for r in range(batch)]  # one request per prefill: within max_num_tokens
    return prefills, main(context, context + rows, list(range(batch))), 1 + batch * blocks_per


def _rebuild_fp32(engine: Path, checkpoint: Path, tmp: Path) -> Path:
    """A copy of the engine whose main package is compiled with fp32 weights (freezing)."""
    from builder import compile_aoti
    from models.engine_format import write_engine_config

    copy = tmp / "engine-fp32"
    shutil.copytree(engine, copy)
    cfg = load_engine_config(copy)
    model, _ = load_model(checkpoint)
    model = model.eval().fuse()
    pkg = cfg.graph_file(0, "main", AOTI_KIND)
    assert pkg is not None
    pkg.unlink()
    compile_aoti.compile_graph("main", model, cfg.kv.geometry(), cfg.kv.table_width, pkg, "float32")
    write_engine_config(cfg)
    return copy


def _torch_compile(checkpoint: Path, geom, ptr):
    from builder.graphs import MainGraph

    model, _ = load_model(checkpoint)
    wrapper = MainGraph(model.eval().fuse(), geom)
    fn = torch.compile(wrapper, dynamic=False, options={"cpp_wrapper": True})  # static: compiled per shape

    def run(inp: MainInput):
        t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (inp.input_ids, inp.positions, inp.q_counts,
                                                                  inp.kv_lens, inp.block_tables, inp.logit_rows)]  # fmt: skip
        with torch.inference_mode():
            h, lg = fn(*t, ptr)
        return MainOutput(h.numpy(), lg.numpy())

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--engine", type=Path, required=True, help="built with mtp-build --compile aoti")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rows", type=int, default=1, help="rows per request in the timed step (1 = plain decode)")
    p.add_argument("--context", type=int, default=90)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--candidates", nargs="+", default=["torch", "onnxruntime", "aoti", "aoti-fp32", "compile"])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_engine_config(args.engine)
    tmp = Path(tempfile.mkdtemp(prefix="mtp-compare-"))
    blocks = cfg.kv.num_blocks
    runners: dict[str, Any] = {}
    for name in args.candidates:
        t0 = time.perf_counter()
        ex: Any
        if name == "torch":
            model, _ = load_model(args.checkpoint)
            ex = TorchExecutor(model, blocks, cfg.kv.block_size)
        elif name == "onnxruntime":
            ex = OrtExecutor(args.engine, num_blocks=blocks, intra_op_threads=1)
        elif name == "aoti":
            ex = CompiledExecutor(args.engine)
        elif name == "aoti-fp32":
            ex = CompiledExecutor(_rebuild_fp32(args.engine, args.checkpoint, tmp))
        elif name == "compile":
            ex = CompiledExecutor(args.engine)  # its pool; the torch.compile'd graph writes it by address
            ex.run_main = _torch_compile(args.checkpoint, ex.geom, torch.tensor([ex.pool.data_ptr()]))
        else:
            raise SystemExit(f"unknown candidate {name!r}")
        runners[name] = ex
        print(f"{name}: ready in {time.perf_counter() - t0:.1f}s", flush=True)
    results: dict[str, dict] = {}
    for batch in args.batches:
        prefills, step, need = step_inputs(batch, args.rows, args.context, cfg.kv.block_size, cfg.kv.table_width,
                                          cfg.model.vocab_size)  # fmt: skip
        if need > blocks:
            raise SystemExit(f"batch {batch} needs {need} blocks, the engine has {blocks}")
        ref = None
        for name, ex in runners.items():
            for prefill in prefills:
                ex.run_main(prefill)
            logits = ex.run_main(step).logits
            tokens = np.argmax(logits, -1)
            if ref is None:
                ref = (tokens, logits)
            diff = float(np.abs(logits - ref[1]).max())
            print(f"batch {batch} {name}: greedy {'==' if np.array_equal(tokens, ref[0]) else '!='} first, "
                  f"max |logit diff| {diff:.2e}", flush=True)  # fmt: skip
        times: dict[str, list[float]] = {n: [] for n in runners}
        names = list(runners)
        for rnd in range(args.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                ex = runners[name]
                ts = []
                for _ in range(args.iters):
                    t0 = CLOCK()
                    ex.run_main(step)
                    ts.append(CLOCK() - t0)
                times[name].append(statistics.median(ts) * 1e3)
        base = times.get("torch")
        print(f"\nbatch {batch}, {args.rows} row(s) per request, context {args.context}, {args.rounds} rounds:")
        print(f"{'candidate':12s} {'median ms':>10s} {'best ms':>9s} {'x torch (same rounds)':>22s}")
        results[str(batch)] = {}
        for name, ts in times.items():
            ratio = statistics.median(a / b for a, b in zip(ts, base, strict=True)) if base else float("nan")
            print(f"{name:12s} {statistics.median(ts):10.3f} {min(ts):9.3f} {ratio:22.3f}")
            results[str(batch)][name] = {"median_ms": statistics.median(ts), "best_ms": min(ts), "x_torch": ratio}
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
