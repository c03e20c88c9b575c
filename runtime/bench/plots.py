"""mtp-bench plots: the two PNG figures drawn from the results dict that runtime/bench/report.py builds.

Owns acceptance_by_position.png (per-position draft acceptance, unconditional and conditional) and
tokens_per_second_vs_k.png (decode throughput vs draft depth, HF `generate` as dashed baselines). It only reads
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
    acc = results["acceptance"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in ((axes[0], "acceptance_rate_per_position", "unconditional P(accept position i)"),
                           (axes[1], "conditional_acceptance_per_position", "P(accept i | accepted 0..i-1)")):  # fmt: skip
        for name, style in (("K=3", "o-"), ("K=3 no commit pass", "s--")):
            if name in acc:
                ys = acc[name][key]
                ax.plot(range(1, len(ys) + 1), ys, style, label=name)
        for name in ("K=1", "K=2"):
            if name in acc:
                ys = acc[name][key]
                ax.plot(range(1, len(ys) + 1), ys, ".:", alpha=0.6, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.02)
        ax.set_xticks(range(1, 1 + max((len(v[key]) for v in acc.values()), default=1)))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance rate")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"MTP draft acceptance by position, greedy ({label})", fontsize=11)
    return fig


def _plot_tps_vs_k(plt, results: dict, label: str):
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = {}  # batch -> line colour, so HF's dashed baseline matches its MTP line
    for batch, row in results["tokens_per_second"]["mtp"].items():
        ks = sorted(int(k) for k in row)
        line = ax.plot(ks, [row[str(k)]["decode_tps_median"] for k in ks], "o-", label=f"MTP batch {batch}")
        colors[batch] = line[0].get_color()
    for batch, hf in results["tokens_per_second"].get("hf", {}).items():
        ax.axhline(hf["decode_tps_median"], ls="--", color=colors.get(batch, "gray"), label=f"HF generate batch {batch}")
    ax.set_xlabel("draft depth K (0 = plain decoding)")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_xticks(sorted({int(k) for row in results["tokens_per_second"]["mtp"].values() for k in row}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"decode throughput vs draft depth ({label})", fontsize=10)
    return fig
