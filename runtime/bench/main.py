"""mtp-bench: our MTP engine beside Hugging Face transformers and llama.cpp, interleaved in one run.

    mtp-bench --checkpoint models/tiny --engine engines/bench [--quick]
    mtp-bench --random --quick --executors torch   # no trained model: a random tiny checkpoint (labelled so)

Workload: the first --prompt-chars characters of held-out Python stdlib files (the files models/training/train.py
held out of training), greedy, --max-tokens output tokens each. Configurations, all at --threads threads:
ours with K = 0 (plain decoding) .. 4 draft depths and K=auto at batch 1 and 8 on the torch, onnxruntime and
compiled (AOTInductor packages, `mtp-build --compile aoti`) executors; HF `generate` (batch 1 and 8, left-padded) and `generate(use_mtp=True)` (batch 1); llama.cpp plain
and `--spec-type draft-mtp` K=1..3 (batch 1) on the GGUF of the same checkpoint (`make bench-peers`). Every
configuration runs once per round, --repeats rounds, medians reported. Our MTP outputs are checked against
our K=0 (greedy MTP must be lossless: exit status 1 otherwise); HF and llama.cpp against ours (informational).

Outputs in --output-dir: bench.json (every number, the command, the machine), README.md (tables generated
from bench.json, with the memory-bandwidth bound per step beside each measured step) and two PNG plots.

This module owns the CLI and the measuring (warm-up -> interleaved timed rounds -> no-commit ablation).
What runs is runtime/bench/setup.py's; aggregation and bench.json runtime/bench/report.py's; the markdown
tables runtime/bench/table.py's; the plots runtime/bench/plots.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runtime.bench.gguf import GGUFError
from runtime.bench.llama_cpp import LlamaCppError
from runtime.bench.runners import RunResult
from runtime.bench.setup import DEFAULT_LLAMA_BIN, DEFAULT_LLAMA_SRC, BenchSetup, make_setup
from runtime.core.config import ConfigError
from runtime.core.engine import RequestError

DEFAULT_KS = "0,1,2,3,4,auto"


def parse_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def parse_ks(text: str) -> list[str]:
    """Comma-separated draft depths: integers >= 0 and/or `auto` (the engine's own choice)."""
    out = []
    for x in (t.strip() for t in text.split(",")):
        if x and x != "auto" and not (x.isdigit()):
            raise argparse.ArgumentTypeError(f"K must be an integer >= 0 or 'auto', got {x!r}")
        if x:
            out.append(x if x == "auto" else str(int(x)))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-bench", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", type=Path, help="Hugging Face checkpoint directory (e.g. models/tiny)")
    m.add_argument("--random", action="store_true", help="benchmark a random tiny checkpoint (no trained model)")
    m.add_argument("--engine", type=Path,
                   help="engine directory for the onnxruntime and compiled executors (built if missing)")
    m.add_argument("--executors", default="torch,onnxruntime,compiled",
                   help="our executors, comma-separated (default torch,onnxruntime,compiled; the last two need --engine, "
                   "compiled an engine built with --compile aoti)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=8, help="prompts per run (held-out stdlib files)")
    w.add_argument("--prompt-chars", type=int, default=200, help="characters taken from the start of each file")
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--ks", type=parse_ks, default=parse_ks(DEFAULT_KS), help=f"our draft depths (default {DEFAULT_KS})")
    w.add_argument("--batches", type=parse_ints, default=[1, 8], help="batch sizes (default 1,8)")
    w.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported")
    w.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, 2 repeats (a smoke run)")
    w.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads for every engine (torch, ORT, llama.cpp); default: OMP_NUM_THREADS, else the cores "
                   "this process may use")  # fmt: skip
    w.add_argument("--max-seq-len", type=int, default=None,
                   help="torch executor KV table width (default: sized to the workload, prompt + output + drafts)")
    peers = p.add_argument_group("peers")
    peers.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers generate")
    peers.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    peers.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_BIN, help="llama.cpp bin dir (make bench-peers)")
    peers.add_argument("--llama-src", type=Path, default=DEFAULT_LLAMA_SRC, help="llama.cpp source (GGUF converter)")
    peers.add_argument("--llama-ks", type=parse_ints, default=[1, 2, 3], help="llama.cpp draft-mtp depths (1,2,3)")
    peers.add_argument("--dram-gbps", type=float, default=25.0, help="memory bandwidth for the per-step bound (GB/s)")
    p.add_argument("--output-dir", type=Path, default=Path("bench_results"))
    return p


def normalize_args(args) -> None:
    """Apply --quick and --threads, and make K=0 part of every run; in place, before anything is built."""
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats = min(args.num_prompts, 4), min(args.max_tokens, 32), 2
    from runtime.factory import use_threads

    # Before torch starts its pools; also seen by ORT's and the plugin ops' OpenMP (docs/BENCHMARKS.md, "Threads").
    args.threads = use_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    args.executors = [x.strip() for x in args.executors.split(",") if x.strip()]
    bad = [x for x in args.executors if x not in ("torch", "onnxruntime", "compiled")]
    if bad or not args.executors:
        raise ConfigError(f"--executors: unknown {', '.join(bad) or '(none)'}; choose from torch,onnxruntime,compiled")
    ks = list(dict.fromkeys(["0", *args.ks]))  # K=0 is the reference for speed-ups and losslessness
    args.int_ks = sorted(int(k) for k in ks if k != "auto")
    args.ks = [str(k) for k in args.int_ks] + (["auto"] if "auto" in ks else [])
    args.llama_ks = sorted({k for k in args.llama_ks if k > 0})
    if min(args.batches) < 1 or args.repeats < 1 or args.num_prompts < 1:
        raise ConfigError("--batches, --repeats and --num-prompts must be >= 1")


def print_banner(console, args, setup: BenchSetup) -> None:
    prompts = setup.workload.prompts
    console.print(f"[bold]mtp-bench[/] {setup.label}: {len(prompts)} prompts "
                  f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens, {setup.workload.tokenized_with}), "
                  f"max_tokens={args.max_tokens}, K={','.join(args.ks)}, batches={args.batches}, "
                  f"repeats={args.repeats}, executors={','.join(args.executors)}, threads={args.threads}, "
                  f"{len(setup.plan)} configurations per round")  # fmt: skip
    for note in setup.notes:
        console.print(f"[yellow]note:[/] {note}")


def measure(args, setup: BenchSetup, console) -> tuple[dict[tuple[str, str, int], list[RunResult]], RunResult | None]:
    """Warm every runner up, then time the plan round-robin (so drift and background load hit all alike)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(setup.plan) * args.repeats + len(setup.warmups) + (1 if setup.ablation else 0)
    progress = Progress(TextColumn("[progress.description]{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)  # fmt: skip
    runs: dict[tuple[str, str, int], list[RunResult]] = {}
    abl = None
    with progress:
        task = progress.add_task("warm-up", total=total)
        for name, fn in setup.warmups:  # allocation, kernel selection, ORT init, page cache: not timed
            progress.update(task, description=f"warm-up {name}")
            fn()
            progress.advance(task)
        for r in range(args.repeats):
            for entry in setup.plan:
                progress.update(task, description=f"round {r + 1} {entry.name}")
                runs.setdefault(entry.key, []).append(entry.run())
                progress.advance(task)
        if setup.ablation is not None:
            progress.update(task, description=f"ablation {setup.ablation.name}")
            abl = setup.ablation.run()
            progress.advance(task)
    return runs, abl


def run(args, argv: list[str]) -> int:
    """setup -> measure -> report; exit status 1 when any of our MTP outputs differs from our K=0."""
    from rich.console import Console

    from runtime.bench.plots import plot
    from runtime.bench.report import build_results, print_tables, print_verdict, write_json
    from runtime.bench.table import write_readme

    console = Console() if Console().is_terminal else Console(width=150)
    normalize_args(args)
    setup = make_setup(args, console)
    print_banner(console, args, setup)
    runs, abl = measure(args, setup, console)
    results = build_results(args, argv, setup, runs, abl)
    json_path = write_json(results, args.output_dir)
    readme = write_readme(results, args.output_dir)
    pngs = plot(results, args.output_dir, setup.label)
    print_tables(console, results)
    print_verdict(console, results)
    console.print(f"wrote {json_path}, {readme}, {', '.join(map(str, pngs))}")
    if setup.tmp is not None:
        setup.tmp.cleanup()
    return 1 if results["warnings"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # mtp-bench serve: the serving benchmark (runtime/bench/serve_bench.py)
        from runtime.bench.serve_bench import main as serve_main

        return serve_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return run(args, argv)
    except (ConfigError, RequestError, FileNotFoundError, LlamaCppError, GGUFError) as e:
        print(f"mtp-bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
