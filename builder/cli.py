"""`mtp-build`: build an engine directory from a checkpoint, or `--check` an existing one.

Owns argument parsing, the rich progress display, the summary table and how failures reach the user: one line
naming the problem and the fix, never a traceback (`--debug` shows them). The work is builder/pipeline.py
(build) and models/engine_format/ (check). Exit codes: 0 ok, 1 internal error (a bug), 2 bad input / failed
check, 128+N killed by signal N (the temporary build directory is removed first).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from builder.compile_check import check_compiled
from builder.options import (
    BACKENDS,
    COMPILES,
    DTYPES,
    INT4_GROUP_DEFAULT,
    QUANTIZE_MTPS,
    QUANTIZES,
    BuildError,
    BuildOptions,
    default_ep_size,
)
from builder.pipeline import build
from builder.signals import BuildInterrupted, interrupted_by
from builder.validate import check_engine_tokenizer, check_tokenizer_config
from models.checkpoint import CheckpointError
from models.engine_format import MANIFEST_NAME, EngineConfig, EngineDirError, load_engine_config
from plugins.threads import set_threads


class RichReporter:
    """Prints each step as it starts and what it produced (per rank) with its time."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def step(self, name: str) -> None:
        self.console.print(f"[bold cyan]>[/] {name}")

    def done(self, what: str, seconds: float) -> None:
        self.console.print(f"  [green]wrote[/] {what} [dim]({seconds:.1f}s)[/]")

    def track(self, items: Sequence[str], what: str) -> Iterator[str]:
        """A progress bar over items (one line per item when the output is not a terminal)."""
        columns = (TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(what, total=len(items))
            for item in items:
                bar.update(task, description=f"{what}: {item}")
                t0 = time.perf_counter()
                yield item
                bar.advance(task)
                self.console.print(f"  [green]compiled[/] {item} [dim]({time.perf_counter() - t0:.1f}s)[/]")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-build", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, help="Hugging Face checkpoint directory (config.json + safetensors)")
    p.add_argument("--output", type=Path, help="engine directory to write")
    p.add_argument("--check", type=Path, metavar="ENGINE_DIR", help="check an engine directory and exit")
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--max-batch", type=int, default=8, help="max requests per step")
    p.add_argument("--max-num-tokens", type=int, default=256, help="max packed rows per main forward")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument("--num-draft-tokens", type=int, default=2, help="K: MTP draft depths per step")
    p.add_argument("--world-size", type=int, default=1, help="ranks W (mpirun -np W); one graph set per rank")
    p.add_argument("--ep-size", type=int, default=None,
                   help="ranks the routed experts are split over: 1 or W (tp 1), tp-size or W (tp > 1); "
                   "default: 1, or --tp-size when it is > 1")  # fmt: skip
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel group size (divides W; W/tp data-parallel groups); docs/ARCHITECTURE.md §8")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="replace an --output engine directory that is incomplete or from another version (never a "
                   "directory mtp-build did not write, never the checkpoint)")  # fmt: skip
    p.add_argument("--compile", default="auto", choices=COMPILES,
                   help="aoti: also compile each graph into an AOTInductor CPU package (the fastest CPU executor, "
                   "what `mtp-run --engine` then runs; about a minute per graph); auto (default): aoti wherever "
                   "it can be built (CPU backend, not a hybrid model); none: ONNX graphs only (a quick build)")  # fmt: skip
    p.add_argument("--quantize", default="none", choices=QUANTIZES,
                   help="int8: the compiled engine stores its dense linears (attention, dense MLPs, shared experts; "
                   "not the embeddings, LM head or router) and its routed experts as weight-only int8 with "
                   "per-channel scales (lossy, half the bytes of bf16); int4: the dense linears and routed experts "
                   "whose input widths are multiples of the group as group-wise int4 (0.5625 bytes per weight at 64), "
                   "the rest as int8 (multi-rank: each rank its own shard, its routed experts included); float checkpoints only")  # fmt: skip
    p.add_argument("--quantize-mtp", default="same", choices=QUANTIZE_MTPS,
                   help="same (default): the MTP module's graphs are quantized as --quantize quantizes the trunk; "
                   "none: they keep the checkpoint's precision (for when the quantized head drafts worse)")  # fmt: skip
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantize: the LM head int8 too (per output channel) in every quantized graph; by default "
                   "it stays float (its error reaches every logit); at real size it is most of a draft step's bytes")  # fmt: skip
    p.add_argument("--int4-group-size", type=int, default=INT4_GROUP_DEFAULT,
                   help="with --quantize int4: input features per fp32 scale (even; default 64: the same bytes as "
                   "llama.cpp's Q4_0); a linear whose input width it does not divide is stored int8")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads of the build (torch export, quantization, --check) and of the rank processes it "
                   "starts; default: OMP_NUM_THREADS, else the cores this process may use (torch's own count)")  # fmt: skip
    p.add_argument("--keep-onnx", action="store_true",
                   help="with the compiled engine: keep the ONNX graphs' fp32 weights too, so `--executor onnxruntime` "
                   "can run it (and `auto` falls back to it where the packages cannot run); by default a compiled "
                   "engine carries only its packages' weights (the ONNX weights were several times their size)")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    return p


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def summary(cfg: EngineConfig, seconds: float | None) -> Table:
    compiled = cfg.build.get("compiled")
    title = (
        f"engine {cfg.path} ({cfg.backend}{', compiled (aoti)' if compiled else ''}, {cfg.dtype}, "
        f"world_size={cfg.world_size})"
    )
    if seconds is not None:
        title += f" built in {seconds:.1f}s"
        if compiled:  # config.json keeps rank 0's compile record
            title += (
                f", AOTInductor compile {sum(g.get('seconds', 0) for g in compiled['graphs'].values()):.1f}s (rank 0)"
            )
    table = Table(title=title)
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("sha256")
    total = 0
    for rel in [MANIFEST_NAME, *sorted(cfg.files)]:  # the manifest covers every other file, config.json too
        size = (cfg.path / rel).stat().st_size
        total += size
        table.add_row(rel, _size(size), cfg.files.get(rel, "-")[:12])
    table.add_row("[bold]total[/]", f"[bold]{_size(total)}[/]", "")
    return table


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)  # error messages stay on one greppable line
    try:
        return _run(args, err)
    except (BuildError, EngineDirError, CheckpointError) as e:
        if args.debug:
            raise
        if (signum := interrupted_by()) is not None:  # a library wrapped the signal's exception: still a signal
            return _interrupted(err, args, signum)
        err.print(f"[bold red]{'check' if args.check is not None else 'build'} failed:[/] {_line(e)}", highlight=False)
        return 2
    except (BuildInterrupted, KeyboardInterrupt) as e:
        if args.debug:
            raise
        return _interrupted(err, args, e.signum if isinstance(e, BuildInterrupted) else signal.SIGINT)
    except Exception as e:  # a bug: one line by default, the traceback with --debug
        if args.debug:
            raise
        err.print(f"[bold red]internal error:[/] {type(e).__name__}: {_line(e)} (a bug in mtp-build; rerun with --debug "
                  "for the traceback and report it)", highlight=False)  # fmt: skip
        return 1


def _interrupted(err: Console, args: argparse.Namespace, signum: int) -> int:
    err.print(f"[bold red]build interrupted by {signal.Signals(signum).name}[/]: the temporary build directory "
              f"was removed; {args.output or 'the output'} is unchanged", highlight=False)  # fmt: skip
    return 128 + signum


def _line(e: BaseException) -> str:
    """The message on one line, with rich markup escaped (messages quote lists like ['norm.weight'])."""
    return escape(" ".join(str(e).split()))


def _run(args: argparse.Namespace, err: Console) -> int:
    console = Console(stderr=False)
    if args.threads is not None:  # else torch's own count, the cores this process may use (plugins/threads.py)
        if args.threads < 1:
            raise BuildError(f"--threads {args.threads}: must be >= 1 (default: the cores this process may use)")
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the rank processes a multi-rank build starts inherit it
        set_threads(args.threads)
    if args.check is not None:
        t0 = time.perf_counter()
        cfg = load_engine_config(args.check)
        check_tokenizer_config(args.check)  # mtp-serve loads it: a broken one must fail here, not at its start-up
        check_engine_tokenizer(args.check, cfg.model.vocab_size)  # so do mtp-run and mtp-serve
        console.print(summary(cfg, None))
        console.print(f"[green]ok[/]: {check_compiled(cfg)}")
        console.print(f"[green]ok[/]: schema {cfg.schema_version}, plugins {cfg.plugins['nodes']}, "
                      f"{cfg.world_size} rank(s), {len(cfg.files)} files verified in {time.perf_counter() - t0:.1f}s")  # fmt: skip
        return 0
    if args.checkpoint is None or args.output is None:
        err.print("[bold red]error:[/] --checkpoint DIR and --output ENGINE_DIR are required (or --check ENGINE_DIR)")
        return 2
    ep_size = args.ep_size
    if ep_size is None:  # the only valid values with tp > 1 are tp-size and world-size: the TP group's is the default
        ep_size = default_ep_size(args.tp_size)
        if ep_size > 1:
            console.print(f"--ep-size not given: using --ep-size {ep_size} (= --tp-size: the routed experts are split "
                          "over each TP group)", highlight=False)  # fmt: skip
    opts = BuildOptions(
        checkpoint=args.checkpoint, output=args.output, backend=args.backend, dtype=args.dtype,
        max_batch=args.max_batch, max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
        kv_block_size=args.kv_block_size, num_draft_tokens=args.num_draft_tokens, world_size=args.world_size,
        ep_size=ep_size, tp_size=args.tp_size, force=args.force, compile=args.compile, quantize=args.quantize,
        quantize_mtp=args.quantize_mtp, quantize_lm_head=args.quantize_lm_head, int4_group_size=args.int4_group_size,
        keep_onnx=args.keep_onnx,
    )  # fmt: skip
    result = build(opts, RichReporter(console))
    console.print(summary(result.config, result.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
