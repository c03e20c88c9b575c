"""mtp-bench reporting: turns the measured runs into bench.json and rich tables.

Owns the aggregation (medians, speed-ups vs K=0 and vs HF, the per-position acceptance table), the losslessness
checks (every greedy MTP output must equal K=0), the results dict and its JSON/console rendering (the PNG plots
of that dict are runtime/bench/plots.py's). It must not run a model or time anything: runtime/bench/main.py measures
and hands over a `BenchSetup` and a `Measurements`.
The JSON keys and their order are the published format of bench_results/bench.json (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from runtime.bench.runners import BenchSetup, RunResult

if TYPE_CHECKING:  # annotations only: bench.py imports this module, not the other way round
    from runtime.engine import LLMEngine

# The per-position acceptance numbers copied from Metrics.summary() into the acceptance table.
ACCEPTANCE_KEYS = ("mean_acceptance_length", "acceptance_rate_per_position", "conditional_acceptance_per_position")

DEFINITIONS = {
    "decode_tps": "tokens emitted by engine steps with no prefill work / time in those steps "
                  "(HF: tokens after the first / time from the first to the last generated position)",
    "e2e_tps": "all generated tokens / wall time of the run, prefill included",
    "host_fraction": "1 - executor time / step time (scheduling, planning, acceptance, numpy glue)",
    "acceptance_rate_per_position": "accepted at draft position i / proposed at position i",
    "conditional_acceptance_per_position": "P(accept i | positions 0..i-1 accepted)",
    "mean_acceptance_length": "tokens emitted per verify step, bonus token included",
}  # fmt: skip


@dataclass
class Measurements:
    runs: dict[tuple[str, int, int], list[RunResult]]  # ("mtp" | "hf", K, batch) -> one result per round
    ablation: RunResult | None  # K=max without the commit pass, at the largest batch; None when max K is 0


# ----------------------------------------------------------------------------------------------- aggregation


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def _tps_entry(kind: str, rs: list[RunResult]) -> dict:
    """Medians over the rounds of one configuration; engine runs add step timing and acceptance length."""
    entry = {
        "decode_tps_median": _med([x.decode_tps for x in rs]),
        "decode_tps_runs": [round(x.decode_tps, 2) for x in rs],
        "decode_tps_best": round(max(x.decode_tps for x in rs), 2),  # least disturbed by other load
        "e2e_tps_median": _med([x.e2e_tps for x in rs]),
        "e2e_tps_runs": [round(x.e2e_tps, 2) for x in rs],
        "generated_tokens": rs[0].total_tokens,
        "wall_seconds_runs": [round(x.wall_seconds, 3) for x in rs],
    }
    if kind == "mtp":
        s = [x.summary for x in rs]
        entry.update({
            "step_time_ms_median": _med([x["step_time_ms"] for x in s]),
            "executor_time_ms_median": _med([x["executor_time_ms"] for x in s]),
            "host_fraction_median": round(statistics.median([x["host_fraction"] for x in s]), 4),
            "mean_acceptance_length": s[0]["mean_acceptance_length"],
            "num_steps": s[0]["num_steps"],
            "summaries": s,
        })  # fmt: skip
    return entry


def tokens_per_second(meas: Measurements) -> dict:
    """{"mtp": {batch: {K: entry}}, "hf": {batch: entry}}, each MTP entry with its speed-ups vs K=0 and HF."""
    tps: dict = {"mtp": {}, "hf": {}}
    for (kind, k, b), rs in meas.runs.items():
        if kind == "mtp":
            tps["mtp"].setdefault(str(b), {})[str(k)] = _tps_entry(kind, rs)
        else:
            tps["hf"][str(b)] = _tps_entry(kind, rs)
    for b, row in tps["mtp"].items():
        base = row["0"]["decode_tps_median"]
        hf_base = tps["hf"].get(b, {}).get("decode_tps_median")
        for entry in row.values():
            entry["speedup_vs_k0"] = round(entry["decode_tps_median"] / base, 3) if base else None
            entry["speedup_vs_hf"] = round(entry["decode_tps_median"] / hf_base, 3) if hf_base else None
            entry["e2e_speedup_vs_k0"] = round(entry["e2e_tps_median"] / row["0"]["e2e_tps_median"], 3)
    return tps


def acceptance_table(meas: Measurements, ks: list[int], max_b: int, ablation_k: int | None) -> dict:
    """Per-position acceptance for each K > 0 (first round at the largest batch), plus the no-commit ablation."""
    acceptance = {}
    for k in ks:
        if k:
            summ = meas.runs[("mtp", k, max_b)][0].summary
            acceptance[f"K={k}"] = {key: summ[key] for key in ACCEPTANCE_KEYS}
    if meas.ablation is not None:
        name = f"K={ablation_k} no commit pass"
        acceptance[name] = {key: meas.ablation.summary[key] for key in ACCEPTANCE_KEYS}
        acceptance[name]["decode_tps"] = round(meas.ablation.decode_tps, 2)
    return acceptance


# ----------------------------------------------------------------------------------------------- losslessness


def first_mismatch(got: list[list[int]], ref: list[list[int]]) -> list[dict]:
    bad = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g != r:
            pos = next((j for j, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
            bad.append({"prompt": i, "first_diff_at": pos, "len": [len(g), len(r)]})
    return bad


def lossless_checks(meas: Measurements, batches: list[int], ablation_k: int | None) -> tuple[dict, list[str]]:
    """Every MTP round (and the ablation) against K=0 at the same batch; a K>0 mismatch is a warning."""
    checks, warnings = {}, []
    for b in batches:
        ref = meas.runs[("mtp", 0, b)][0].outputs
        for (kind, k, bb), rs in meas.runs.items():
            if kind != "mtp" or bb != b:
                continue
            for r, res in enumerate(rs):
                bad = first_mismatch(res.outputs, ref)
                checks[f"K={k} batch {b} round {r + 1} == K=0 batch {b}"] = bad if bad else "ok"
                if bad and k:
                    warnings.append(f"K={k} batch {b} round {r + 1}: {len(bad)}/{len(ref)} outputs differ from K=0 "
                                    f"(first at prompt {bad[0]['prompt']}, token {bad[0]['first_diff_at']})")  # fmt: skip
    if meas.ablation is not None:
        max_b = max(batches)
        bad = first_mismatch(meas.ablation.outputs, meas.runs[("mtp", 0, max_b)][0].outputs)
        checks[f"K={ablation_k} no commit pass batch {max_b} == K=0"] = bad if bad else "ok"
        if bad:
            warnings.append(f"K={ablation_k} without commit pass: {len(bad)} outputs differ from K=0")
    return checks, warnings


def reference_checks(meas: Measurements, batches: list[int], has_hf: bool) -> dict:
    """Informational only (never a warning): batching and HF's float32 path may legitimately flip a near-tie."""
    info_checks = {}
    max_b = max(batches)
    if len(batches) > 1:
        bad = first_mismatch(meas.runs[("mtp", 0, max_b)][0].outputs, meas.runs[("mtp", 0, min(batches))][0].outputs)
        info_checks[f"K=0 batch {max_b} == K=0 batch {min(batches)}"] = bad if bad else "ok"
    if has_hf:
        for b in batches:
            ref = meas.runs[("mtp", 0, 1 if 1 in batches else b)][0].outputs
            bad = first_mismatch(meas.runs[("hf", 0, b)][0].outputs, ref)
            info_checks[f"HF batch {b} == K=0"] = bad if bad else "ok"
    return info_checks


# ----------------------------------------------------------------------------------------------- results dict


def machine_info() -> dict:
    import torch

    info = {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "numpy": np.__version__,
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


def _num_params(engine: LLMEngine) -> int | None:
    model = getattr(engine.executor, "model", None)
    return sum(p.numel() for p in model.parameters()) if model is not None else None


def _describe_setup(args, setup: BenchSetup) -> dict:
    """The "settings", "model" and "workload" sections: what was run, on which checkpoint and prompts."""
    work, model_cfg, hf = setup.workload, setup.engines[0].model_cfg, setup.hf
    return {
        "settings": {
            "checkpoint": "random (models.testing.tiny_config, seed 0)" if setup.is_random else str(args.checkpoint),
            "executor": args.executor,
            "engine_dir": str(args.engine) if args.executor == "onnxruntime" else None,
            "ks": args.ks, "batches": args.batches, "repeats": args.repeats, "max_tokens": args.max_tokens,
            "num_prompts": len(work.prompts), "prompt_chars": args.prompt_chars, "greedy": True,
            "enable_prefix_caching": False, "max_seq_len": setup.max_seq_len,
            "hf_transformers": hf.version if hf else None,
        },
        "model": {"vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.hidden_size,
                  "num_hidden_layers": model_cfg.num_hidden_layers, "num_mtp_modules": model_cfg.num_mtp_modules,
                  "parameters": _num_params(setup.engines[0])},
        "workload": {"files": work.sources, "heldout_from_training": work.heldout, "tokenized_with": work.tokenized_with,
                     "prompt_tokens": [len(p) for p in work.prompts]},
    }  # fmt: skip


def build_results(args, argv: list[str], setup: BenchSetup, meas: Measurements) -> dict:
    """Everything bench.json holds; key order is the file's order."""
    max_b = max(args.batches)
    checks, warnings = lossless_checks(meas, args.batches, setup.ablation_k)
    return {
        "label": setup.label,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", "runtime.bench", *argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        **_describe_setup(args, setup),
        "tokens_per_second": tokens_per_second(meas),
        "acceptance": acceptance_table(meas, args.ks, max_b, setup.ablation_k),
        "lossless_checks": checks,
        "reference_checks": reference_checks(meas, args.batches, setup.hf is not None),
        "warnings": warnings,
        "definitions": DEFINITIONS,
    }


def write_json(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    return json_path


# ----------------------------------------------------------------------------------------------- console


def print_tables(console, results: dict, args) -> None:
    console.print(_tps_table(results, args))
    console.print(_acceptance_view(results, args))


def _tps_table(results: dict, args):
    from rich.table import Table

    t = Table(title=f"decode tokens/s, median of {args.repeats} ({results['label']}, {args.executor} executor)")
    for col in ("config", "batch", "decode tok/s", "vs K=0", "vs HF", "e2e tok/s", "accept len", "step ms",
                "host frac"):  # fmt: skip
        t.add_column(col, justify="left" if col == "config" else "right")
    tps = results["tokens_per_second"]
    for b in map(str, args.batches):
        if b in tps["hf"]:
            h = tps["hf"][b]
            t.add_row("HF generate", b, f"{h['decode_tps_median']:.1f}", "", "1.00x", f"{h['e2e_tps_median']:.1f}",
                      "", "", "")  # fmt: skip
        for k, e in tps["mtp"][b].items():
            vs_hf = f"{e['speedup_vs_hf']:.2f}x" if e["speedup_vs_hf"] else "-"
            t.add_row(f"MTP K={k}", b, f"{e['decode_tps_median']:.1f}", f"{e['speedup_vs_k0']:.2f}x", vs_hf,
                      f"{e['e2e_tps_median']:.1f}", f"{e['mean_acceptance_length']:.2f}", f"{e['step_time_ms_median']:.1f}",
                      f"{e['host_fraction_median']:.2f}", end_section=k == str(args.ks[-1]))  # fmt: skip
    return t


def _acceptance_view(results: dict, args):
    from rich.table import Table

    a = Table(title="greedy draft acceptance by position (unconditional / conditional)")
    a.add_column("config")
    a.add_column("accept len", justify="right")
    for i in range(max(args.ks)):
        a.add_column(f"pos {i + 1}", justify="right")
    for name, v in results["acceptance"].items():
        cells = [f"{u:.3f} / {c:.3f}" for u, c in zip(v["acceptance_rate_per_position"],
                                                       v["conditional_acceptance_per_position"], strict=True)]  # fmt: skip
        a.add_row(name, f"{v['mean_acceptance_length']:.2f}", *cells, *[""] * (max(args.ks) - len(cells)))
    return a


def print_verdict(console, results: dict) -> None:
    """The losslessness verdict: a red warning per mismatching MTP run, then the informational reference checks."""
    for w in results["warnings"]:
        console.print(f"[bold red]WARNING: not lossless:[/] {w}")
    if not results["warnings"]:
        num_checks = len(results["lossless_checks"])
        console.print(f"[green]lossless:[/] every MTP output equals K=0 ({num_checks} comparisons)")
    for name, v in results["reference_checks"].items():
        console.print(f"[dim]reference check {name}: {'ok' if v == 'ok' else f'{len(v)} prompts differ'}[/]")
