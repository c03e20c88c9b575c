"""mtp-run: generate from prompts with MTP speculative decoding; streams text, then prints stats.

    mtp-run --engine DIR --prompt "def main(" [--max-tokens 64] [--num-draft-tokens 3] [--json]
    mpirun -np 2 mtp-run --engine DIR_EP2 --prompts-file prompts.txt --json

--json prints JSON Lines: one object per request, then {"summary": {...}} (format in README.md).
Under mpirun the world size and mapping come from the engine (docs/RUNTIME.md, "Multi-rank mappings"): the
leader of DP group d serves prompts[d::dp_size], its TP followers replay its executor calls, and only
rank 0 prints (it gathers the other leaders' results). --collective-timeout arms the watchdog.

Errors are one line on stderr (`--debug` adds the traceback): exit 2 for bad input, 1 for a rejected
request or an internal error, 130 for Ctrl-C (a single process still prints every finished request).
Under mpirun a failing rank prints one line naming itself and the job ends; ranks started with different
settings all exit with one line naming the first differing field (runtime/multirank/parallel.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from runtime.core.acceptance_guard import CHECK_MODES, DEFAULT_CHECK_MODE
from runtime.core.admission import RequestError, validate_params
from runtime.core.config import ConfigError
from runtime.core.sampling import SamplingParams
from runtime.core.self_check import start_up_check
from runtime.factory import EXECUTORS, create_engine, torch_threads, use_threads
from runtime.multirank.parallel import EveryRankError, describe, exit_failed_rank, mpi_world
from runtime.multirank.strategies import lead_or_follow
from runtime.multirank.watchdog import DEFAULT_TIMEOUT_S, check_timeout

PROG = "mtp-run"


def _draft_tokens_flag(text: str) -> int | str:
    """An int (range-checked with the other settings: one line naming the setting), "auto" or "per-request"."""
    return text if text in ("auto", "per-request") else int(text)


# Errors that mean the user's input (flags, files, engine directory) is wrong: one line, exit 2.
BAD_INPUT = (ConfigError, RequestError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-run", description=__doc__.splitlines()[0])
    src = p.add_argument_group("model")
    src.add_argument("--engine", type=Path, help="engine directory built by mtp-build")
    src.add_argument("--checkpoint", type=Path, help="checkpoint directory (torch executor, no build needed)")
    src.add_argument("--executor", choices=EXECUTORS, default="auto",
                     help="default auto: an engine's compiled packages if built (else onnxruntime); torch for --checkpoint")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    prompts.add_argument("--prompts-file", type=Path, help="one prompt per line ('-': standard input)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--acceptance", choices=["exact", "rejection"], default="exact")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    r = p.add_argument_group("runtime")
    r.add_argument("--num-draft-tokens", type=_draft_tokens_flag, default=None,
                   help="K draft depths; 0 disables MTP; auto picks 0..K per step; per-request (default): 0..K per request")
    r.add_argument("--no-commit-pass", action="store_true", help="ablation: skip the MTP decode refresh")
    r.add_argument("--no-fused-draft", action="store_true", help="one call per draft depth (no fused draft loop)")
    r.add_argument("--max-batch", type=int, default=None)
    r.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads (torch, our kernels, ONNX Runtime); default: OMP_NUM_THREADS, else the cores this "
                   "process may use")  # fmt: skip
    r.add_argument("--max-num-tokens", type=int, default=None)
    r.add_argument("--num-blocks", type=int, default=None)
    r.add_argument("--prefill-chunk", type=int, default=None, help="longest prefill chunk per step")
    r.add_argument("--no-prefix-caching", action="store_true")
    r.add_argument("--num-state-snapshots", type=int, default=None, metavar="N",
                   help="hybrid (Gated DeltaNet) models: recurrent-state snapshots kept for prefix caching "
                        "(default 4 x max batch; 0 turns their prefix caching off)")
    r.add_argument("--state-snapshot-interval", type=int, default=None, metavar="TOKENS",
                   help="hybrid (Gated DeltaNet) models: prompt tokens between two state snapshots a prefill stores "
                        "for prefix caching, a multiple of the block size (default 128; 0: only each chunk's last)")
    r.add_argument("--tp-size", type=int, default=None,
                   help="--checkpoint under mpirun: tensor-parallel group size (an engine records its own)")
    r.add_argument("--acceptance-check", choices=CHECK_MODES, default=DEFAULT_CHECK_MODE,
                   help="start-up self-check of MTP acceptance on built-in prompts: warn (one line when implausibly "
                        "low), strict (exit instead), off (skip; saves ~1 s on models/deep)")
    r.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="under mpirun: a rank blocked this long in a collective exits with one line (default 60)")
    p.add_argument("--json", action="store_true", help="JSON Lines output (see README)")
    p.add_argument("--debug", action="store_true", help="print the Python traceback of an error")
    return p


def read_prompts(args, world: int = 1) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    if str(args.prompts_file) == "-":
        if world > 1:  # mpirun forwards stdin to rank 0 only: the other ranks would read nothing
            raise EveryRankError("--prompts-file - (standard input) works in a single process; under mpirun give "
                                 "a file every rank can read")  # fmt: skip
        return _prompt_lines(sys.stdin.read(), "standard input")
    if not args.prompts_file.exists():
        raise ConfigError(f"--prompts-file {args.prompts_file} does not exist")
    if not args.prompts_file.is_file():
        raise ConfigError(f"--prompts-file {args.prompts_file} is not a file; give a text file, one prompt per line")
    try:
        text = args.prompts_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompts-file {args.prompts_file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return _prompt_lines(text, str(args.prompts_file))


def _prompt_lines(text: str, source: str) -> list[str]:
    lines = [line.rstrip("\n").replace("\\n", "\n") for line in text.splitlines()]
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts-file {source} has no prompts (one per line, blank lines skipped)")
    return prompts


def run(args, rank: int = 0, world: int = 1) -> int:
    executor = args.executor
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens, stop=tuple(args.stop), acceptance=args.acceptance)  # fmt: skip
    # Checked before the engine loads (seconds): the flags are the same for every prompt, so a bad one is
    # a bad command line, not N rejected requests. No end_id comes from the CLI, so the vocab bound is moot.
    validate_params(params, vocab_size=2**63)
    check_timeout(args.collective_timeout)
    prompts = read_prompts(args, world)
    if executor == "tensorrt":
        from runtime.executors.trt_executor import tensorrt_runtime_missing

        missing = tensorrt_runtime_missing()
        if missing:
            raise ConfigError(f"--executor tensorrt cannot run here: {missing}; use --executor onnxruntime on CPU")
    threads = use_threads(args.threads)
    engine = create_engine(
        args.engine, args.checkpoint, executor, rank=rank, world_size=world, threads=threads,
        num_draft_tokens=args.num_draft_tokens, max_batch=args.max_batch, max_num_tokens=args.max_num_tokens,
        num_blocks=args.num_blocks, max_prefill_chunk=args.prefill_chunk,
        enable_prefix_caching=False if args.no_prefix_caching else None, num_state_snapshots=args.num_state_snapshots,
        state_snapshot_interval=args.state_snapshot_interval,
        commit_pass=False if args.no_commit_pass else None, fused_draft=False if args.no_fused_draft else None,
        collective_timeout=args.collective_timeout, prog=PROG,
        tp_size=args.tp_size,
    )  # fmt: skip
    start_up_check(engine, args.acceptance_check, PROG)  # single process only (skipped under mpirun)
    return lead_or_follow(engine.ranks, lambda: _lead(engine, args, params, prompts, world), PROG, args.debug)


def _lead(engine, args, params: SamplingParams, prompts: list[str], world: int) -> int:
    """A rank that steps the engine: its DP group's share of the prompts, then the records (group 0 prints all)."""
    ranks = engine.ranks
    dp_rank, dp_size = ranks.dp_rank, ranks.dp_size
    mine = list(range(dp_rank, len(prompts), dp_size))
    ids, errors = {}, {}
    for i in mine:
        try:
            ids[engine.add_request(prompts[i], params, req_id=f"prompt-{i}")] = i
        except RequestError as e:  # rejected alone; the others run
            errors[i] = str(e)
    stream_live = not args.json and world == 1 and len(prompts) == 1
    t0 = time.perf_counter()
    finals, shown, interrupted = {}, "", False
    try:
        for out in engine.stream():
            if stream_live and out.new_token_ids and out.text.startswith(shown):
                sys.stdout.write(out.text[len(shown) :])  # print only the new text (a stop string may cut it back)
                shown = out.text
                sys.stdout.flush()
            if out.finished:
                finals[ids[out.req_id]] = out
    except KeyboardInterrupt:
        if world > 1:  # the other ranks are inside a collective: this rank cannot finish alone
            raise
        interrupted = True  # a single process keeps what finished and prints it below
        errors.update({i: "interrupted (Ctrl-C) before it finished" for i in mine if i not in finals})
    wall = time.perf_counter() - t0
    ranks.stop()  # the followers leave follow() and exit 0
    records = [_record(prompts[i], finals.get(i), errors.get(i)) for i in mine]
    summary = {"executor": engine.executor_name, "threads": torch_threads(),
               **engine.metrics.summary(wall, len(mine))}  # fmt: skip
    if dp_size > 1:  # one record set per DP group, from its leader
        gathered = ranks.gather_to_first((mine, records, summary, engine.metrics, wall))
        if gathered is None:
            return 0
        order = [i for g in gathered for i in g[0]]
        records = [r for _, r in sorted(zip(order, [r for g in gathered for r in g[1]], strict=True), key=lambda x: x[0])]
        merged = gathered[0][3]
        for g in gathered[1:]:
            merged.merge(g[3])
        summary = {"executor": engine.executor_name, "threads": torch_threads(),
                   **merged.summary(max(g[4] for g in gathered), len(records)),
                   "per_rank": [g[2] for g in gathered]}  # fmt: skip
    if stream_live:
        print()
    _print(records, summary, args.json)
    if interrupted:
        print(f"{PROG}: interrupted: {len(finals)} of {len(mine)} request(s) finished", file=sys.stderr)
        return 130
    return 1 if errors else 0


def _record(prompt: str, out, error: str | None) -> dict:
    if out is None:
        return {"prompt": prompt, "error": error or "not finished"}
    rec = {"prompt": prompt, "text": out.text, "output_ids": out.output_ids, "num_steps": out.num_steps,
           "accepted_per_step": out.accepted_per_step, "finish_reason": out.finish_reason}  # fmt: skip
    if out.finish_reason == "error":  # the engine aborted this request alone (e.g. non-finite logits)
        rec["error"] = out.error
    return rec


def _print(records: list[dict], summary: dict, as_json: bool) -> None:
    if as_json:
        for rec in records:
            print(json.dumps(rec))
        print(json.dumps({"summary": summary}))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for rec in records:
        if len(records) > 1:
            console.rule(repr(rec["prompt"][:60]))
            console.print(rec.get("text", ""), markup=False)
        if "error" in rec:
            console.print(f"[red]request rejected: {rec['error']}[/red]")
    table = Table(title="mtp-run")
    table.add_column("metric")
    table.add_column("value")
    for key in ("executor", "threads", "num_requests", "num_generated_tokens", "tokens_per_second", "mean_acceptance_length",
                "acceptance_rate_per_position", "conditional_acceptance_per_position", "step_time_ms",
                "host_fraction", "prefix_cache_hit_tokens", "kv_blocks_used_peak", "kv_blocks_free"):  # fmt: skip
        table.add_row(key, str(summary.get(key)))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _, rank, world = mpi_world()
    try:
        return run(args, rank, world)
    except EveryRankError as e:  # raised on every rank alike: all exit 2, rank 0 says why
        if rank == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # noqa: BLE001 - every path below prints one line and exits non-zero
        if isinstance(e, SystemExit):
            raise
        code = 130 if isinstance(e, KeyboardInterrupt) else 2 if isinstance(e, BAD_INPUT) else 1
        if world > 1:  # the others are (or will be) blocked in a collective: end the job
            exit_failed_rank(rank, e, PROG, args.debug, code)
        if args.debug:
            traceback.print_exception(e)
        hint = "" if code != 1 else " (rerun with --debug for the traceback)"
        print(f"{PROG}: {'interrupted' if code == 130 else 'error: ' + describe(e)}{hint}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
