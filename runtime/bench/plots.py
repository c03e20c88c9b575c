"""mtp-bench plots: the two PNG figures drawn from the results dict that runtime/bench/report.py builds.

Owns acceptance_by_position.png (per-position draft acceptance, unconditional and conditional, per engine) and
tokens_per_second_vs_k.png (decode throughput vs draft depth, one line per engine and batch). It only reads
the results dict; matplotlib is imported lazily (headless Agg backend) so the CLI's `--help` stays fast.
"""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, out_dir: Path, label: str) -> list[Path]:
    """acceptance_by_position.png and tokens_per_second_vs_k.png under out_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # headless: the bench runs over ssh and in CI
    import matplotlib.pyplot as plt

    paths = []
    figures = ((_plot_acceptance, "acceptance_by_position.png"), (_plot_tps_vs_k, "tokens_per_second_vs_k.png"))
    for draw, name in figures:
        fig = draw(plt, results, label)
        fig.tight_layout()
        p = out_dir / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _plot_acceptance(plt, results: dict, label: str):
    """Each drafting engine's largest-K run (solid), its smaller Ks (dotted) and the no-commit ablation (dashed)."""
    acc = results["acceptance"]
    if any(n.startswith("torch ") for n in acc):  # the executors compute the same model: same acceptance
        acc = {n: v for n, v in acc.items() if not n.startswith("onnxruntime ")}
    largest: dict[str, str] = {}
    for name in acc:
        engine, _, k = name.partition(" K=")
        if k.isdigit() and int(k) > int(largest.get(engine, "0")):
            largest[engine] = k
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "acceptance_rate_per_position", "unconditional P(accept position i)"),
                           (axes[1], "conditional_acceptance_per_position", "P(accept i | accepted 0..i-1)")):  # fmt: skip
        for name, v in acc.items():
            engine, _, k = name.partition(" K=")
            style = "o-" if largest.get(engine) == k else ("s--" if "no commit" in k else ".:")
            ys = v[key]
            ax.plot(range(1, len(ys) + 1), ys, style, alpha=1.0 if style != ".:" else 0.6, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.02)
        ax.set_xticks(range(1, 1 + max((len(v[key]) for v in acc.values()), default=1)))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance rate")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"MTP draft acceptance by position, greedy ({label})", fontsize=11)
    return fig


def _plot_tps_vs_k(plt, results: dict, label: str):
    """Median decode tok/s against K, one line per engine and batch; K=auto drawn right of the largest K."""
    tps = results["tokens_per_second"]
    max_k = max((int(k) for e in tps.values() for row in e.values() for k in row if k.isdigit()), default=0)
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for engine, by_batch in tps.items():
        for batch, row in by_batch.items():
            ks = sorted(row, key=lambda k: int(k) if k.isdigit() else max_k + 1)
            xs = [int(k) if k.isdigit() else max_k + 1 for k in ks]
            ys = [row[k]["decode_tps_median"] for k in ks]
            style = "o-" if engine in ("torch", "onnxruntime", "compiled") else "s--"
            ax.plot(xs, ys, style, label=f"{engine} batch {batch}")
    has_auto = any("auto" in row for e in tps.values() for row in e.values())
    ticks = list(range(max_k + 1)) + ([max_k + 1] if has_auto else [])
    ax.set_xticks(ticks, [str(t) for t in range(max_k + 1)] + (["auto"] if has_auto else []))
    ax.set_xlabel("draft depth K (0 = plain decoding)")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"decode throughput vs draft depth, {results['settings']['threads']} thread(s) ({label})", fontsize=10)
    return fig
