"""mtp-bench verify lengths: per-request k_i (--num-draft-tokens per-request) against K=0, a fixed K and `auto`.

    python -m runtime.bench.verify_lengths_bench --checkpoint models/deep --pairs 5

Every side runs on one shared torch executor (runtime/bench/setup.py says why), interleaved: each round runs
every side once, in a rotated order, and reports each side's decode tokens per CPU second over K=0's in that
round; the table gives the median ratio per side and batch. Greedy outputs of every side must equal K=0's
(exit status 1 otherwise)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from runtime.bench.auto_guard import _rate, _repeat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mtp-bench-verify-lengths", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--pairs", type=int, default=5, help="rounds (every side once per round)")
    p.add_argument("--max-k", type=int, default=3)
    p.add_argument("--sides", default="auto,per-request", help="compared with K=0 and K=max-k")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-seconds", type=float, default=0.5)
    args = p.parse_args(argv)

    from runtime.bench.runners import make_workload, warm_up
    from runtime.bench.setup import engine_factory
    from runtime.factory import load_tokenizer

    vocab = int(json.loads((args.checkpoint / "config.json").read_text())["vocab_size"])
    work = make_workload(args.checkpoint, args.num_prompts, args.prompt_chars, vocab, load_tokenizer(args.checkpoint))
    batches = [int(b) for b in args.batches.split(",")]
    engine_for = engine_factory(argparse.Namespace(int_ks=[args.max_k], batches=batches, max_tokens=args.max_tokens,
                                                    max_seq_len=None, threads=1, engine=None,
                                                    checkpoint=args.checkpoint), work)  # fmt: skip
    names = ["0", str(args.max_k), *args.sides.split(",")]
    engines = {n: engine_for("torch", n) for n in names}
    for e in engines.values():
        warm_up(e, work.prompts)
    failures = []
    for b in batches:
        ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
        for i in range(args.pairs):
            order = names[i % len(names) :] + names[: i % len(names)]
            runs = {
                n: _repeat(engines[n], work.prompts, b, args.max_tokens, f"{n}-{i}", args.min_seconds) for n in order
            }
            base = _rate(runs["0"], "decode_cpu_seconds")
            for n in names[1:]:
                ratios[n].append(_rate(runs[n], "decode_cpu_seconds") / base)
                if any(r.outputs != runs["0"][0].outputs for r in runs[n]):
                    failures.append(f"batch {b} round {i + 1}: {n}'s greedy outputs differ from K=0's")
        for n, rs in ratios.items():
            print(f"batch {b}  {'K=' + n if n.isdigit() else n:>12}: median {statistics.median(rs):.3f}x of K=0 "
                  f"(min {min(rs):.3f}, max {max(rs):.3f}, {len(rs)} rounds)")  # fmt: skip
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
