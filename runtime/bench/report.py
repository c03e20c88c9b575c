"""mtp-bench reporting: turns the measured runs into the results dict (bench.json) and the console tables.

Owns the aggregation (medians, speed-ups vs the engine's own K=0 and vs HF, the memory-bandwidth bound per
step, the per-position acceptance table), the losslessness checks (every greedy MTP output of ours must
equal our K=0), the reference checks against HF and llama.cpp, and bench.json. It must not run a model or
time anything: runtime/bench/main.py measures and hands over the runs.
The JSON keys are the published format of bench_results/bench.json (docs/BENCHMARKS.md, "bench.json").
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from runtime.bench.bound import bound_summary, step_bound_seconds
from runtime.bench.runners import RunResult
from runtime.bench.setup import BenchSetup

Runs = dict[tuple[str, str, int], list[RunResult]]
OURS = ("torch", "onnxruntime", "compiled")
# The per-position acceptance numbers copied from a run's summary into the acceptance table.
ACCEPTANCE_KEYS = ("mean_acceptance_length", "acceptance_rate_per_position", "conditional_acceptance_per_position")

DEFINITIONS = {
    "decode_tps": "tokens emitted in the decode phase / time of the decode phase. Ours: engine steps with no "
                  "prefill work; HF: tokens after the first / first to last generated position; llama.cpp: "
                  "its own timers (plain: eval + sampling time; draft-mtp: the 'decoded N tokens' line)",
    "e2e_tps": "all generated tokens / wall time of the run, prefill included (llama.cpp: prompt + decode "
               "timers, model load excluded)",
    "step_ms": "decode time / target-model forwards (verify steps) in it",
    "bound_step_ms": "weight bytes one step must read / DRAM bandwidth (runtime/bench/bound.py)",
    "bound_tps": "batch * mean acceptance length / bound_step_ms",
    "host_fraction": "1 - executor time / step time (scheduling, planning, acceptance, numpy glue)",
    "acceptance_rate_per_position": "accepted at draft position i / verify steps",
    "conditional_acceptance_per_position": "P(accept i | positions 0..i-1 accepted)",
    "mean_acceptance_length": "tokens emitted per verify step, bonus token included",
}  # fmt: skip


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def _entry(engine: str, k: str, batch: int, rs: list[RunResult], setup: BenchSetup, bandwidth: float) -> dict:
    """Medians over the rounds of one configuration, its step time and its bound."""
    steps = [x.decode_seconds * 1e3 / x.decode_steps for x in rs if x.decode_steps]
    accept = rs[0].summary.get("mean_acceptance_length") if k != "0" else 1.0
    e = {
        "decode_tps_median": _med([x.decode_tps for x in rs]),
        "decode_tps_runs": [round(x.decode_tps, 2) for x in rs],
        "decode_tps_best": round(max(x.decode_tps for x in rs), 2),  # least disturbed by other load
        "e2e_tps_median": _med([x.e2e_tps for x in rs]),
        "e2e_tps_runs": [round(x.e2e_tps, 2) for x in rs],
        "generated_tokens": rs[0].total_tokens,
        "wall_seconds_runs": [round(x.wall_seconds, 3) for x in rs],
        "step_ms_median": _med(steps) if steps else None,
        "mean_acceptance_length": accept,
    }
    k_int = setup.engines[(engine, k)].k if k == "auto" and (engine, k) in setup.engines else k
    if str(k_int).isdigit():
        bound = step_bound_seconds(setup.model_cfg, int(k_int), batch, bandwidth=bandwidth) * 1e3
        e["bound_step_ms"] = round(bound, 5)
        e["bound_tps"] = round(batch * (accept or 1.0) / bound * 1e3, 1)
    if engine in OURS:
        s = [x.summary for x in rs]
        e.update({"step_time_ms_median": _med([x["step_time_ms"] for x in s]),
                  "executor_time_ms_median": _med([x["executor_time_ms"] for x in s]),
                  "host_fraction_median": round(statistics.median([x["host_fraction"] for x in s]), 4),
                  "num_steps": s[0]["num_steps"], "summaries": s})  # fmt: skip
    elif rs[0].summary:
        e["summary"] = rs[0].summary
    return e


def tokens_per_second(runs: Runs, setup: BenchSetup, bandwidth: float) -> dict:
    """{engine: {batch: {K: entry}}}; each entry with its speed-up vs the engine's K=0 and vs HF (same batch)."""
    tps: dict = {}
    for (engine, k, b), rs in runs.items():
        tps.setdefault(engine, {}).setdefault(str(b), {})[k] = _entry(engine, k, b, rs, setup, bandwidth)
    for by_batch in tps.values():
        for b, row in by_batch.items():
            base = row.get("0", {}).get("decode_tps_median")
            hf = tps.get("hf", {}).get(b, {}).get("0", {}).get("decode_tps_median")
            for e in row.values():
                e["speedup_vs_k0"] = round(e["decode_tps_median"] / base, 3) if base else None
                e["speedup_vs_hf"] = round(e["decode_tps_median"] / hf, 3) if hf else None
    return tps


def acceptance_table(runs: Runs, ablation: RunResult | None, setup: BenchSetup) -> dict:
    """Per-position acceptance of every K > 0 run (first round, largest batch that engine ran), plus the ablation."""
    acc: dict = {}
    for (engine, k, b), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        summ = rs[0].summary
        if k != "0" and all(key in summ for key in ACCEPTANCE_KEYS):
            acc[f"{engine} K={k}"] = {key: summ[key] for key in ACCEPTANCE_KEYS} | {"batch": b}
    if ablation is not None and setup.ablation is not None:
        acc[f"{setup.ablation.engine} K={setup.ablation.k}"] = {key: ablation.summary[key] for key in ACCEPTANCE_KEYS}
        acc[f"{setup.ablation.engine} K={setup.ablation.k}"] |= {"batch": setup.ablation.batch,
                                                                "decode_tps": round(ablation.decode_tps, 2)}  # fmt: skip
    return acc


def first_mismatch(got: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """Where each differing output first differs from its reference (empty: all equal)."""
    bad = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g != r:
            pos = next((j for j, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
            bad.append({"prompt": i, "first_diff_at": pos, "len": [len(g), len(r)]})
    return bad


def lossless_checks(runs: Runs, ablation: RunResult | None, setup: BenchSetup) -> tuple[dict, list[str]]:
    """Every round of ours (and the ablation) against our K=0 of the same executor and batch; mismatch = warning."""
    checks, warnings = {}, []
    for (engine, k, b), rs in runs.items():
        if engine not in OURS:
            continue
        ref = runs[(engine, "0", b)][0].outputs
        for r, res in enumerate(rs):
            bad = first_mismatch(res.outputs, ref)
            checks[f"{engine} K={k} batch {b} round {r + 1} == K=0"] = bad or "ok"
            if bad and k != "0":
                warnings.append(f"{engine} K={k} batch {b} round {r + 1}: {len(bad)}/{len(ref)} outputs differ from "
                                f"K=0 (first at prompt {bad[0]['prompt']}, token {bad[0]['first_diff_at']})")  # fmt: skip
    if ablation is not None and setup.ablation is not None:
        a = setup.ablation
        bad = first_mismatch(ablation.outputs, runs[(a.engine, "0", a.batch)][0].outputs)
        checks[f"{a.engine} K={a.k} batch {a.batch} == K=0"] = bad or "ok"
        if bad:
            warnings.append(f"{a.engine} K={a.k}: {len(bad)} outputs differ from K=0")
    return checks, warnings


def reference_checks(runs: Runs, setup: BenchSetup) -> dict:
    """Informational (never a warning): batching, another executor, HF's float32 path or llama.cpp's kernels
    may legitimately flip a near-tie."""
    info: dict = {}
    ex0 = next(iter(setup.engines))[0]
    batches = sorted({b for (e, _, b) in runs if e == ex0})
    ref = runs[(ex0, "0", batches[0])][0].outputs
    for (engine, k, b), rs in runs.items():
        if engine == "llama.cpp" or (engine in OURS and k != "0") or (engine, k, b) == (ex0, "0", batches[0]):
            continue  # llama.cpp is compared as text below; our K > 0 runs are lossless_checks'
        bad = first_mismatch(rs[0].outputs, ref)
        info[f"{engine} K={k} batch {b} == {ex0} K=0 batch {batches[0]}"] = bad or "ok"
    tok = next(iter(setup.engines.values())).tokenizer
    ref1 = runs.get((ex0, "0", 1))
    for (engine, k, _b), rs in runs.items():
        if engine != "llama.cpp" or tok is None or ref1 is None:
            continue
        ours = [tok.decode(ids) for ids in ref1[0].outputs]
        texts = rs[0].texts or []
        # draft-mtp may run a few tokens past max_tokens (runtime/bench/llama_cpp.py): ours must be its prefix
        bad_text = [{"prompt": i, "first_diff_char": next((j for j, (x, y) in enumerate(zip(a, t, strict=False))
                                                           if x != y), min(len(a), len(t)))}
                    for i, (a, t) in enumerate(zip(texts, ours, strict=True))
                    if not (a == t or (k != "0" and a.startswith(t)))]  # fmt: skip
        n_ours = [len(p) for p in setup.workload.prompts]
        bad_prompt = [i for i, n in enumerate(rs[0].summary.get("prompt_tokens", [])) if n != n_ours[i]]
        info[f"llama.cpp K={k} text == {ex0} K=0 text" + (" (prefix)" if k != "0" else "")] = bad_text or "ok"
        info[f"llama.cpp K={k} prompt token counts == ours"] = "ok" if not bad_prompt else {"prompts": bad_prompt}
    return info


def machine_info(threads: int) -> dict:
    import torch

    info = {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads_per_engine": threads,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        import onnxruntime

        info["onnxruntime_version"] = onnxruntime.__version__
    except ImportError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def _describe(args, setup: BenchSetup) -> dict:
    """The "settings", "model" and "workload" sections: what was run, on which checkpoint and prompts."""
    work, cfg, hf = setup.workload, setup.model_cfg, setup.hf
    model = getattr(next(iter(setup.engines.values())).executor, "model", None)
    return {
        "settings": {
            "checkpoint": "random (models.testing.tiny_config, seed 0)" if setup.is_random else str(args.checkpoint),
            "executors": args.executors, "engine_dir": str(args.engine) if set(args.executors) - {"torch"} else None,
            "ks": args.ks, "batches": args.batches, "repeats": args.repeats, "max_tokens": args.max_tokens,
            "threads": args.threads, "num_prompts": len(work.prompts), "prompt_chars": args.prompt_chars,
            "greedy": True, "enable_prefix_caching": False, "max_seq_len": setup.max_seq_len,
            "hf_transformers": hf.version if hf else None, "llama_cpp": (setup.llama | {"lost_log_retries": setup.llama_runner.retries}) if setup.llama_runner else None,
        },
        "model": {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                  "num_hidden_layers": cfg.num_hidden_layers, "num_mtp_modules": cfg.num_mtp_modules,
                  "parameters": sum(p.numel() for p in model.parameters()) if model is not None else None},
        "workload": {"files": work.sources, "heldout_from_training": work.heldout, "tokenized_with": work.tokenized_with,
                     "prompt_tokens": [len(p) for p in work.prompts]},
    }  # fmt: skip


def build_results(args, argv: list[str], setup: BenchSetup, runs: Runs, ablation: RunResult | None) -> dict:
    """Everything bench.json holds; key order is the file's order."""
    bandwidth = args.dram_gbps * 1e9
    checks, warnings = lossless_checks(runs, ablation, setup)
    return {
        "label": setup.label,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", "runtime.bench", *argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(args.threads),
        **_describe(args, setup),
        "bound": bound_summary(setup.model_cfg, bandwidth=bandwidth),
        "tokens_per_second": tokens_per_second(runs, setup, bandwidth),
        "acceptance": acceptance_table(runs, ablation, setup),
        "lossless_checks": checks,
        "reference_checks": reference_checks(runs, setup),
        "notes": setup.notes,
        "warnings": warnings,
        "definitions": DEFINITIONS,
    }


def write_json(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def print_tables(console, results: dict) -> None:
    """The same rows as the README tables (runtime/bench/table.py), as rich tables."""
    from rich.table import Table

    from runtime.bench.table import acceptance_rows, throughput_rows

    for title, rows in ((f"decode throughput, median of {results['settings']['repeats']} ({results['label']}, "
                         f"{results['settings']['threads']} thread(s))", throughput_rows(results)),
                        ("greedy draft acceptance by position (unconditional / conditional)",
                         acceptance_rows(results))):  # fmt: skip
        if not rows:
            continue
        t = Table(title=title)
        for col in rows[0]:
            t.add_column(col, justify="left" if col in ("engine", "config") else "right")
        for r in rows:
            t.add_row(*map(str, r.values()))
        console.print(t)


def print_verdict(console, results: dict) -> None:
    """The losslessness verdict: a red warning per mismatching MTP run, then the informational reference checks."""
    for w in results["warnings"]:
        console.print(f"[bold red]WARNING: not lossless:[/] {w}")
    if not results["warnings"]:
        console.print(f"[green]lossless:[/] every MTP output of ours equals K=0 ({len(results['lossless_checks'])} "
                      "comparisons)")  # fmt: skip
    for name, v in results["reference_checks"].items():
        console.print(f"[dim]reference check {name}: {'ok' if v == 'ok' else v}[/]")
    for note in results["notes"]:
        console.print(f"[yellow]note:[/] {note}")
