"""mtp-bench serve: per-run statistics, serve_bench.json, the markdown table and the latency-vs-rate plots.

Pure aggregation and formatting; nothing here sends a request (runtime/bench/serve_bench.py does).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PCTS = (50, 90, 99)


def _pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {f"p{p}": float("nan") for p in PCTS}
    return {f"p{p}": round(float(np.percentile(xs, p)) * 1000, 3) for p in PCTS}


def summarize(results: list, wall: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.num_output - 1) for r in ok if r.num_output > 1]
    itl = [g for r in ok for g in r.itls]
    out_tokens = sum(r.num_output for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "duration_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 4) if wall else 0.0,
        "output_throughput": round(out_tokens / wall, 3) if wall else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_ms": _pcts([r.ttft for r in ok]),
        "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts(itl),
        "e2e_ms": _pcts([r.latency for r in ok]),
        "errors": errors[:5],
    }


def _label(entry: dict) -> str:
    return f"{entry['frontend']} K={entry['num_draft_tokens']}"


def table(entries: list[dict]) -> str:
    head = ("| target | load | req/s | out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms "
            "| ok |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows = [head]
    for e in entries:
        for r in e.get("runs", []):
            load = f"Poisson {r['rate']:g}/s" if r["mode"] == "poisson" else f"concurrency {r['concurrency']}"

            def f(d: dict) -> str:
                return "/".join(f"{d[f'p{p}']:.0f}" if d[f"p{p}"] >= 10 else f"{d[f'p{p}']:.1f}" for p in PCTS)

            rows.append(f"| {_label(e)} | {load} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
                        f"| {f(r['ttft_ms'])} | {f(r['tpot_ms'])} | {f(r['itl_ms'])} "
                        f"| {r['completed']}/{r['num_requests']} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def plot(entries: list[dict], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for e in entries:
        runs = [r for r in e.get("runs", []) if r["mode"] == "poisson"]
        if not runs:
            continue
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [r["tpot_ms"]["p50"] for r in runs], marker="o", label=_label(e))
        axes[1].plot(rates, [r["ttft_ms"]["p50"] for r in runs], marker="o", label=_label(e))
    for ax, name in zip(axes, ("TPOT p50 (ms)", "TTFT p50 (ms)"), strict=True):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("mtp-bench serve: latency vs request rate")
    fig.tight_layout()
    path = out / "serve_latency_vs_rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(out: Path, meta: dict, entries: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    js = out / "serve_bench.json"
    js.write_text(json.dumps({"meta": meta, "results": entries}, indent=2) + "\n")
    md = out / "serve_table.md"
    md.write_text(table(entries) + "".join(f"\n- {n}" for n in meta.get("notes", [])) + "\n")
    paths = [js, md]
    png = plot(entries, out)
    if png is not None:
        paths.append(png)
    return paths
