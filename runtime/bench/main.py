"""mtp-bench: MTP speculative decoding vs plain decoding vs Hugging Face `generate`, side by side in one run.

    mtp-bench --checkpoint models/tiny [--engine engines/tiny --executor onnxruntime] [--quick]
    mtp-bench --random            # no trained model: a random tiny checkpoint (numbers clearly labelled)

Workload: the first --prompt-chars characters of held-out Python stdlib files (the files models/training/train.py
held out of training), greedy, --max-tokens output tokens each. Every configuration runs in this process:
MTP with K = 0 (plain decoding) .. 3 draft depths at batch 1 and batch 8, then HF `generate` on the same
checkpoint, interleaved over --repeats rounds; medians are reported. Per-position draft acceptance is
measured for each K, plus the K=3 ablation without the commit pass. MTP outputs are checked against K=0
(greedy MTP must be lossless) and a warning is printed on any mismatch.

Outputs: a rich table, <output-dir>/bench.json (every number, the command, the machine) and two PNG plots.

This module owns the measuring: the CLI, the setup and the measurement loop (setup -> warm-up ->
interleaved timed rounds -> no-commit ablation). The workload and the engine / HF runners are
runtime/bench/runners.py's. Everything after the last timed run (aggregation, losslessness checks, bench.json,
tables) is runtime/bench/report.py's, the PNG plots runtime/bench/plots.py's; nothing here formats results,
and neither of those runs a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bench.plots import plot
from runtime.bench.report import Measurements, build_results, print_tables, print_verdict, write_json
from runtime.bench.runners import BenchSetup, HFRunner, RunResult, Workload, make_workload, run_engine
from runtime.config import ConfigError
from runtime.engine import LLMEngine, RequestError
from runtime.factory import create_engine

if TYPE_CHECKING:  # rich is imported lazily so `--help` stays fast
    from rich.progress import Progress, TaskID


# ----------------------------------------------------------------------------------------------- CLI


def parse_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-bench", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", type=Path, help="Hugging Face checkpoint directory (e.g. models/tiny)")
    m.add_argument("--random", action="store_true", help="benchmark a random tiny checkpoint (no trained model)")
    m.add_argument("--engine", type=Path, help="engine directory for --executor onnxruntime (built if missing)")
    m.add_argument("--executor", choices=("torch", "onnxruntime"), default="torch")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=8, help="prompts per run (held-out stdlib files)")
    w.add_argument("--prompt-chars", type=int, default=200, help="characters taken from the start of each file")
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--ks", type=parse_ints, default=[0, 1, 2, 3], help="draft depths to compare (default 0,1,2,3)")
    w.add_argument("--batches", type=parse_ints, default=[1, 8], help="batch sizes (default 1,8)")
    w.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported")
    w.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, 2 repeats (a smoke run)")
    w.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers baseline")
    w.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    w.add_argument("--max-seq-len", type=int, default=None,
                   help="torch executor KV table width (default: sized to the workload, prompt + output + drafts)")
    p.add_argument("--output-dir", type=Path, default=Path("bench_results"))
    return p


# ----------------------------------------------------------------------------------------------- setup


def ensure_engine_dir(checkpoint: Path, engine_dir: Path, max_k: int, max_batch: int, console) -> None:
    """Build engine_dir with mtp-build when it is missing or was built for fewer draft depths / a smaller batch."""
    from plugins.engine_format import EngineDirError, load_engine_config

    try:
        ecfg = load_engine_config(engine_dir)
        if ecfg.num_draft_tokens >= max_k and ecfg.limits.max_batch >= max_batch:
            return
        why = f"built for K={ecfg.num_draft_tokens}, max_batch={ecfg.limits.max_batch}"
    except (EngineDirError, FileNotFoundError) as e:
        why = str(e).splitlines()[0] if engine_dir.exists() else "missing"
    console.print(f"[yellow]building {engine_dir} ({why}) with K={max_k}, max_batch={max_batch}[/]")
    from builder.cli import main as build_main

    rc = build_main(["--checkpoint", str(checkpoint), "--output", str(engine_dir), "--num-draft-tokens", str(max_k),
                     "--max-batch", str(max_batch), "--max-num-tokens", str(max(256, max_batch * (1 + max_k))),
                     "--force"])  # fmt: skip
    if rc != 0:
        raise ConfigError(f"mtp-build failed for {engine_dir} (exit {rc})")


def normalize_args(args) -> None:
    """Apply --quick and --threads, and make K=0 part of every run; in place, before anything is built."""
    import torch

    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats = min(args.num_prompts, 4), min(args.max_tokens, 32), 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if 0 not in args.ks:
        args.ks = [0, *args.ks]  # K=0 is the reference for speed-ups and losslessness
    args.ks = sorted(set(args.ks))
    if min(args.batches) < 1 or args.repeats < 1 or args.num_prompts < 1:
        raise ConfigError("--batches, --repeats and --num-prompts must be >= 1")


def resolve_checkpoint(args) -> tuple[tempfile.TemporaryDirectory | None, str]:
    """Check --checkpoint, or write the --random one into a temporary directory; returns (that dir, label)."""
    if args.random or args.checkpoint is None:
        if not args.random:
            raise ConfigError("give --checkpoint DIR (e.g. models/tiny, made by `make tiny-model`) or --random")
        from models.testing import make_checkpoint, tiny_config

        tmp = tempfile.TemporaryDirectory(prefix="mtp-bench-")
        args.checkpoint = Path(tmp.name) / "random-tiny"
        make_checkpoint(args.checkpoint, tiny_config(), seed=0)
        return tmp, "RANDOM untrained tiny model"
    if not (args.checkpoint / "config.json").is_file():
        raise ConfigError(f"{args.checkpoint} has no config.json; run `make tiny-model` or pass --random")
    trained = (args.checkpoint / "training_report.json").is_file()
    return None, f"{args.checkpoint.name} ({'trained' if trained else 'checkpoint'})"


def engine_factory(args, work: Workload) -> Callable[..., LLMEngine]:
    """engine_for(k, commit_pass=True): every engine sized for the largest K and batch, prefix caching off."""
    max_k, max_b = max(args.ks), max(args.batches)
    block = 16  # RuntimeConfig's default block size; the table width is what the paged attention scans
    max_seq_len = args.max_seq_len or -(-(max(map(len, work.prompts)) + args.max_tokens + 2 * max_k + 1) // block) * block

    def engine_for(k: int, commit_pass: bool = True) -> LLMEngine:
        common = dict(num_draft_tokens=k, max_batch=max_b, commit_pass=commit_pass, enable_prefix_caching=False,
                      max_num_tokens=max(256, max_b * (1 + max_k)))  # fmt: skip
        if args.executor == "onnxruntime":
            return create_engine(args.engine, args.checkpoint, "onnxruntime", **common)
        return create_engine(None, args.checkpoint, "torch", max_seq_len=max_seq_len, **common)

    return engine_for


def load_hf(args, eos: tuple[int, ...], console) -> HFRunner | None:
    if args.no_hf:
        return None
    try:
        return HFRunner(args.checkpoint, eos)
    except Exception as e:  # noqa: BLE001 - the HF baseline is optional
        console.print(f"[yellow]skipping the Hugging Face baseline: {e}[/]")
        return None


def make_setup(args, console) -> BenchSetup:
    """Checkpoint, (ORT engine dir), workload, one engine per K plus the ablation engine, and the HF runner."""
    tmp, label = resolve_checkpoint(args)
    max_k, max_b = max(args.ks), max(args.batches)
    if args.executor == "onnxruntime":
        if args.engine is None:
            raise ConfigError("--executor onnxruntime needs --engine DIR (it is built when missing)")
        ensure_engine_dir(args.checkpoint, args.engine, max_k, max_b, console)

    from runtime.factory import load_tokenizer

    vocab_size = int(json.loads((args.checkpoint / "config.json").read_text())["vocab_size"])
    work = make_workload(args.checkpoint, args.num_prompts, args.prompt_chars, vocab_size,
                         load_tokenizer(args.checkpoint))  # fmt: skip
    engine_for = engine_factory(args, work)
    engines = {k: engine_for(k) for k in args.ks}
    model_cfg = engines[0].model_cfg
    if model_cfg.num_mtp_modules == 0:
        raise ConfigError(f"{args.checkpoint} has no MTP module: nothing to benchmark against K=0")
    ablation_k = max_k if max_k > 0 else None
    ablation = engine_for(ablation_k, commit_pass=False) if ablation_k else None
    hf = load_hf(args, model_cfg.eos_token_id, console)
    return BenchSetup(label, work, engines, ablation, ablation_k, hf, engines[0].cfg.max_seq_len, tmp)


def print_banner(console, args, setup: BenchSetup) -> None:
    import torch

    prompts = setup.workload.prompts
    console.print(f"[bold]mtp-bench[/] {setup.label}: {len(prompts)} prompts "
                  f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens, {setup.workload.tokenized_with}), "
                  f"max_tokens={args.max_tokens}, K={args.ks}, batches={args.batches}, repeats={args.repeats}, "
                  f"executor={args.executor}, torch threads={torch.get_num_threads()}")  # fmt: skip


# ----------------------------------------------------------------------------------------------- measurement


def measure(args, setup: BenchSetup, console) -> Measurements:
    """Warm every configuration up, then time them round-robin (so drift and background load hit all alike)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plan = [("mtp", k, b) for k in args.ks for b in args.batches]
    plan += [("hf", 0, b) for b in args.batches] if setup.hf else []
    total = len(plan) * args.repeats + len(args.ks) + (1 if setup.hf else 0) + (1 if setup.ablation else 0)
    progress = Progress(TextColumn("[progress.description]{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)  # fmt: skip
    with progress:
        task = progress.add_task("warm-up", total=total)
        warm_up(setup, progress, task)
        runs = timed_rounds(args, setup, plan, progress, task)
        abl = None
        if setup.ablation is not None:
            progress.update(task, description=f"ablation K={setup.ablation_k} no commit")
            abl = run_engine(setup.ablation, setup.workload.prompts, max(args.batches), args.max_tokens, "ablation")
            progress.advance(task)
    return Measurements(runs, abl)


def warm_up(setup: BenchSetup, progress: Progress, task: TaskID) -> None:
    """First calls pay one-off costs (allocation, kernel selection, ORT init); keep them out of the timed rounds."""
    warm_prompts = setup.workload.prompts[:2]
    for k, eng in setup.engines.items():
        progress.update(task, description=f"warm-up K={k}")
        run_engine(eng, warm_prompts, 2, 8, f"warm{k}")
        progress.advance(task)
    if setup.hf:
        progress.update(task, description="warm-up HF")
        setup.hf.run(warm_prompts, 2, 8)
        progress.advance(task)


def timed_rounds(args, setup: BenchSetup, plan: list[tuple[str, int, int]], progress: Progress,
                 task: TaskID) -> dict[tuple[str, int, int], list[RunResult]]:  # fmt: skip
    """Every configuration of plan once per round, --repeats rounds; returns (kind, K, batch) -> per-round results."""
    runs: dict[tuple[str, int, int], list[RunResult]] = {}
    prompts = setup.workload.prompts
    for r in range(args.repeats):
        for kind, k, b in plan:
            progress.update(task, description=f"round {r + 1} {'HF' if kind == 'hf' else f'K={k}'} batch {b}")
            if kind == "hf":
                assert setup.hf is not None  # plan has "hf" entries only when the runner loaded
                res = setup.hf.run(prompts, b, args.max_tokens)
            else:
                res = run_engine(setup.engines[k], prompts, b, args.max_tokens, f"r{r}k{k}b{b}")
            runs.setdefault((kind, k, b), []).append(res)
            progress.advance(task)
    return runs


# ----------------------------------------------------------------------------------------------- main


def run(args, argv: list[str]) -> int:
    """setup -> measure -> report; exit status 1 when any MTP output differs from K=0."""
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=130)
    normalize_args(args)
    setup = make_setup(args, console)
    print_banner(console, args, setup)
    meas = measure(args, setup, console)
    results = build_results(args, argv, setup, meas)
    json_path = write_json(results, args.output_dir)
    pngs = plot(results, args.output_dir, setup.label)
    print_tables(console, results, args)
    print_verdict(console, results)
    console.print(f"wrote {json_path}, {', '.join(map(str, pngs))}")
    if setup.tmp is not None:
        setup.tmp.cleanup()
    return 1 if results["warnings"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        return run(args, argv)
    except (ConfigError, RequestError, FileNotFoundError) as e:
        print(f"mtp-bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
