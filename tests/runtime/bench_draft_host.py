"""The draft loop's host path and the compiled executor's call glue against a git revision's, end to end: tokens per
CPU second of a compiled engine, in one process, passes alternating the two. Not a test (timings never assert).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m tests.runtime.bench_draft_host \\
        --engine engines/deep --prompts-file prompts.txt --batch 1 --k 3 --rounds 6 [--rev HEAD]

"before" is `--rev`'s `runtime/core/draft_loop.py` `run` and `ExecutionContext.__call__`, "after" this checkout's,
swapped in on the same engine (the engine's format and packages are the same for both). One JSON line: medians of
tokens per CPU second (on shared cores wall time mostly measures the other tenants) and per-step phase ms. The
greedy outputs of both must be identical (asserted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

from runtime.core import draft_loop
from runtime.core.sampling import SamplingParams
from runtime.core.step_record import StepRecord
from runtime.executors import compiled_executor
from runtime.factory import create_engine


def _module_at(rev: str, path: str) -> types.ModuleType:
    name = f"_{rev}_{Path(path).stem}"
    module = sys.modules[name] = types.ModuleType(name)  # dataclasses look their module up by name
    exec(subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True), module.__dict__)  # noqa: S102
    return module


def _summary(records: list[StepRecord], tokens: int) -> dict[str, float]:
    busy = [r for r in records if r.num_scheduled]
    phases = ("verify", "commit", "draft")
    per_step = {q: 1e3 * sum(r.phase_seconds.get(q, 0.0) for r in busy) / len(busy) for q in phases}
    return {"tok_cpu_s": tokens / sum(r.cpu_seconds for r in records), "steps": len(busy),
            "step_cpu_ms": 1e3 * sum(r.cpu_seconds for r in busy) / len(busy), **per_step}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="built with mtp-build --compile aoti")
    ap.add_argument("--prompts-file", type=Path, required=True, help="one prompt per line")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rev", default="HEAD", help="the revision to compare with")
    args = ap.parse_args()
    prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    ctx = compiled_executor.ExecutionContext
    old_loop = _module_at(args.rev, "runtime/core/draft_loop.py")
    old_ctx = _module_at(args.rev, "runtime/executors/compiled_executor.py").ExecutionContext
    forms = {"before": (old_loop.run, old_ctx.__call__), "after": (draft_loop.run, ctx.__call__)}
    engine = create_engine(args.engine, None, "compiled", threads=1, num_draft_tokens=args.k, max_batch=args.batch)
    records: list[StepRecord] = []
    engine.step_listeners.append(records.append)
    engine.generate(prompts[:2], SamplingParams(max_tokens=16))  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    outputs: dict[str, list[list[int]]] = {}
    for i in range(args.rounds):
        for form in ("before", "after") if i % 2 == 0 else ("after", "before"):
            draft_loop.run, ctx.__call__ = forms[form]  # type: ignore[method-assign]
            records.clear()
            out = [o.output_ids for o in engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens))]
            assert outputs.setdefault(form, out) == out and outputs.get("before", out) == out, "outputs differ"
            runs[form].append(_summary(records, sum(map(len, out))))
    med = {f: {q: round(statistics.median(r[q] for r in rs), 3) for q in rs[0]} for f, rs in runs.items()}
    ratio = med["after"]["tok_cpu_s"] / med["before"]["tok_cpu_s"]
    print(json.dumps({"batch": args.batch, "k": args.k, **med, "after/before": round(ratio, 3)}))


if __name__ == "__main__":
    main()
