"""mtp-bench: MTP speculative decoding vs plain decoding vs Hugging Face `generate`, side by side in one run.

    mtp-bench --checkpoint models/tiny [--engine engines/tiny --executor onnxruntime] [--quick]
    mtp-bench --random            # no trained model: a random tiny checkpoint (numbers clearly labelled)

Workload: the first --prompt-chars characters of held-out Python stdlib files (the files models/train_tiny.py
held out of training), greedy, --max-tokens output tokens each. Every configuration runs in this process:
MTP with K = 0 (plain decoding) .. 3 draft depths at batch 1 and batch 8, then HF `generate` on the same
checkpoint, interleaved over --repeats rounds; medians are reported. Per-position draft acceptance is
measured for each K, plus the K=3 ablation without the commit pass. MTP outputs are checked against K=0
(greedy MTP must be lossless) and a warning is printed on any mismatch.

Outputs: a rich table, <output-dir>/bench.json (every number, the command, the machine) and two PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.config import ConfigError
from runtime.engine import LLMEngine, RequestError
from runtime.factory import create_engine
from runtime.metrics import Metrics
from runtime.sampling import SamplingParams

# Fallback prompt files when the checkpoint has no training_report.json (relative to the stdlib root).
FALLBACK_FILES = ("json/decoder.py", "textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py",
                  "heapq.py", "glob.py", "string.py", "keyword.py", "queue.py", "sched.py")  # fmt: skip


# ----------------------------------------------------------------------------------------------- workload


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids (what both the engine and HF get)
    sources: list[str]  # stdlib-relative file names
    texts: list[str]  # the prompt text (before tokenization)
    tokenized_with: str  # "tokenizer.json" or "bytes % vocab" (no tokenizer)
    heldout: bool  # the files are known to be held out of training


def heldout_files(checkpoint: Path, n: int) -> tuple[list[Path], bool]:
    """n held-out stdlib files, deterministic: the report's held-out list, else train_tiny's split rule."""
    root = Path(sysconfig.get_paths()["stdlib"])
    report = checkpoint / "training_report.json"
    candidates: list[Path] = []
    heldout = False
    if report.is_file():
        paths = json.loads(report.read_text()).get("corpus", {}).get("heldout_paths", [])
        candidates = [root / p for p in paths if (root / p).is_file()]
        heldout = bool(candidates)
    if not candidates:
        try:
            from models.train_tiny import split_files, stdlib_files

            candidates = split_files(stdlib_files(root))[1]
            heldout = bool(candidates)  # same rule train_tiny uses, on the same Python install
        except Exception:  # noqa: BLE001 - fall back to a fixed list
            candidates = []
    if not candidates:
        candidates = [root / f for f in FALLBACK_FILES if (root / f).is_file()]
    # Skip near-empty files (e.g. bare __init__.py) and spread the pick over the whole list.
    candidates = [p for p in candidates if p.stat().st_size >= 400]
    if len(candidates) < n:
        raise ConfigError(f"only {len(candidates)} usable prompt files under {root}; lower --num-prompts")
    stride = len(candidates) / n
    return [candidates[int(i * stride)] for i in range(n)], heldout


def make_workload(checkpoint: Path, n: int, chars: int, vocab_size: int, tokenizer) -> Workload:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, heldout = heldout_files(checkpoint, n)
    texts = [f.read_text(encoding="utf-8", errors="replace")[:chars] for f in files]
    if tokenizer is not None:
        prompts = [list(tokenizer.encode(t).ids) for t in texts]
        how = "tokenizer.json"
    else:
        prompts = [[b % vocab_size for b in t.encode()] for t in texts]
        how = f"utf-8 bytes % vocab ({vocab_size}); no tokenizer"
    return Workload(prompts, [f.relative_to(root).as_posix() for f in files], texts, how, heldout)


# ----------------------------------------------------------------------------------------------- MTP runs


@dataclass
class RunResult:
    outputs: list[list[int]]
    decode_tokens: int  # tokens emitted by steps with no prefill work in them
    decode_seconds: float
    total_tokens: int
    wall_seconds: float
    summary: dict = field(default_factory=dict)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def e2e_tps(self) -> float:
        return self.total_tokens / self.wall_seconds if self.wall_seconds else 0.0


def _drive(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple:
    """Run prompts together to completion; split time into decode-only steps and steps carrying prefill."""
    ids = [engine.add_request(p, params, req_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    mine = [engine.requests[i] for i in ids]
    finals: dict[str, list[int]] = {}
    dec_tokens = total = 0
    dec_seconds = 0.0
    while engine.has_unfinished():
        decode_only = all(r.output_ids for r in mine if not r.is_finished)  # nothing left to prefill
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        n = sum(len(o.new_token_ids) for o in outs)
        total += n
        if decode_only:
            dec_tokens += n
            dec_seconds += dt
        for o in outs:
            if o.finished:
                finals[o.req_id] = o.output_ids
    for i in ids:  # keep the engine's request table small across repeats
        engine.requests.pop(i, None)
    return [finals[i] for i in ids], dec_tokens, dec_seconds, total


def run_engine(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int, tag: str) -> RunResult:
    """batch 1: one request at a time; batch B: B requests in flight together (continuous batching)."""
    engine.metrics = Metrics(engine.k)  # fresh counters per run
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs: list[list[int]] = []
    dec_tokens = total = 0
    dec_seconds = 0.0
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), batch):
        outs, dt, ds, tt = _drive(engine, prompts[lo : lo + batch], params, f"{tag}-{lo}")
        outputs += outs
        dec_tokens, dec_seconds, total = dec_tokens + dt, dec_seconds + ds, total + tt
    wall = time.perf_counter() - t0
    engine.kv.assert_no_leaks()
    return RunResult(outputs, dec_tokens, dec_seconds, total, wall, engine.metrics.summary(wall, len(prompts)))


# ----------------------------------------------------------------------------------------------- HF runs


class HFRunner:
    """transformers `Glm4MoeForCausalLM.generate`, greedy; batch > 1 uses left padding + attention mask."""

    def __init__(self, checkpoint: Path, eos: tuple[int, ...]) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        self.torch = torch
        self.model = transformers.Glm4MoeForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        self.eos = list(eos)
        self.version = transformers.__version__

    def run(self, prompts: list[list[int]], batch: int, max_tokens: int) -> RunResult:
        torch = self.torch
        outputs: list[list[int]] = []
        dec_tokens = total = 0
        dec_seconds = 0.0
        t_start = time.perf_counter()
        for lo in range(0, len(prompts), batch):
            chunk = prompts[lo : lo + batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding: every prompt ends at the last column
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            stamps: list[float] = []

            def stamp(_input_ids, scores, stamps=stamps):  # called once per generated position, after its forward
                stamps.append(time.perf_counter())
                return scores

            with torch.no_grad():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False,
                    eos_token_id=self.eos or None, pad_token_id=0, logits_processor=[stamp],
                )  # fmt: skip
            for row in out[:, width:].tolist():
                cut = next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
                outputs.append(row[:cut])
            n = sum(len(o) for o in outputs[lo:])
            total += n
            if len(stamps) > 1:  # positions 2..n: pure decode forwards (the first one follows the prefill)
                dec_tokens += n - len(chunk)
                dec_seconds += stamps[-1] - stamps[0]
        wall = time.perf_counter() - t_start
        return RunResult(outputs, dec_tokens, dec_seconds, total, wall)


# ----------------------------------------------------------------------------------------------- helpers


def parse_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def first_mismatch(got: list[list[int]], ref: list[list[int]]) -> list[dict]:
    bad = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g != r:
            pos = next((j for j, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
            bad.append({"prompt": i, "first_diff_at": pos, "len": [len(g), len(r)]})
    return bad


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


def ensure_engine_dir(checkpoint: Path, engine_dir: Path, max_k: int, max_batch: int, console) -> None:
    """Build engine_dir with mtp-build when it is missing or was built for fewer draft depths / a smaller batch."""
    from builder.engine_dir import EngineDirError, load_engine_config

    try:
        ecfg = load_engine_config(engine_dir)
        if ecfg.num_draft_tokens >= max_k and ecfg.limits["max_batch"] >= max_batch:
            return
        why = f"built for K={ecfg.num_draft_tokens}, max_batch={ecfg.limits['max_batch']}"
    except (EngineDirError, FileNotFoundError) as e:
        why = str(e).splitlines()[0] if engine_dir.exists() else "missing"
    console.print(f"[yellow]building {engine_dir} ({why}) with K={max_k}, max_batch={max_batch}[/]")
    from builder.cli import main as build_main

    rc = build_main(["--checkpoint", str(checkpoint), "--output", str(engine_dir), "--num-draft-tokens", str(max_k),
                     "--max-batch", str(max_batch), "--max-num-tokens", str(max(256, max_batch * (1 + max_k))),
                     "--force"])  # fmt: skip
    if rc != 0:
        raise ConfigError(f"mtp-build failed for {engine_dir} (exit {rc})")


# ----------------------------------------------------------------------------------------------- plots


def plot(results: dict, out_dir: Path, label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
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
    fig.tight_layout()
    p = out_dir / "acceptance_by_position.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = {}
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
    fig.tight_layout()
    p = out_dir / "tokens_per_second_vs_k.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ----------------------------------------------------------------------------------------------- main


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


def run(args, argv: list[str]) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console() if Console().is_terminal else Console(width=130)
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats = min(args.num_prompts, 4), min(args.max_tokens, 32), 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if 0 not in args.ks:
        args.ks = [0, *args.ks]  # K=0 is the reference for speed-ups and losslessness
    args.ks = sorted(set(args.ks))
    if min(args.batches) < 1 or args.repeats < 1 or args.num_prompts < 1:
        raise ConfigError("--batches, --repeats and --num-prompts must be >= 1")
    tmp = None
    if args.random or args.checkpoint is None:
        if not args.random:
            raise ConfigError("give --checkpoint DIR (e.g. models/tiny, made by `make tiny-model`) or --random")
        from models.testing import make_checkpoint, tiny_config

        tmp = tempfile.TemporaryDirectory(prefix="mtp-bench-")
        args.checkpoint = Path(tmp.name) / "random-tiny"
        make_checkpoint(args.checkpoint, tiny_config(), seed=0)
        label = "RANDOM untrained tiny model"
    else:
        if not (args.checkpoint / "config.json").is_file():
            raise ConfigError(f"{args.checkpoint} has no config.json; run `make tiny-model` or pass --random")
        label = f"{args.checkpoint.name} ({'trained' if (args.checkpoint / 'training_report.json').is_file() else 'checkpoint'})"
    max_k, max_b = max(args.ks), max(args.batches)
    if args.executor == "onnxruntime":
        if args.engine is None:
            raise ConfigError("--executor onnxruntime needs --engine DIR (it is built when missing)")
        ensure_engine_dir(args.checkpoint, args.engine, max_k, max_b, console)

    from runtime.factory import load_tokenizer

    vocab_size = int(json.loads((args.checkpoint / "config.json").read_text())["vocab_size"])
    work = make_workload(args.checkpoint, args.num_prompts, args.prompt_chars, vocab_size,
                         load_tokenizer(args.checkpoint))  # fmt: skip
    block = 16  # RuntimeConfig's default block size; the table width is what the paged attention scans
    max_seq_len = args.max_seq_len or -(-(max(map(len, work.prompts)) + args.max_tokens + 2 * max_k + 1) // block) * block

    def engine_for(k: int, commit_pass: bool = True) -> LLMEngine:
        common = dict(num_draft_tokens=k, max_batch=max_b, commit_pass=commit_pass, enable_prefix_caching=False,
                      max_num_tokens=max(256, max_b * (1 + max_k)))  # fmt: skip
        if args.executor == "onnxruntime":
            return create_engine(args.engine, args.checkpoint, "onnxruntime", **common)
        return create_engine(None, args.checkpoint, "torch", max_seq_len=max_seq_len, **common)

    engines = {k: engine_for(k) for k in args.ks}
    model_cfg = engines[0].model_cfg
    if model_cfg.num_mtp_modules == 0:
        raise ConfigError(f"{args.checkpoint} has no MTP module: nothing to benchmark against K=0")
    max_seq_len = engines[0].cfg.max_seq_len
    ablation_k = max_k if max_k > 0 else None
    ablation = engine_for(ablation_k, commit_pass=False) if ablation_k else None
    hf = None
    if not args.no_hf:
        try:
            hf = HFRunner(args.checkpoint, model_cfg.eos_token_id)
        except Exception as e:  # noqa: BLE001 - the HF baseline is optional
            console.print(f"[yellow]skipping the Hugging Face baseline: {e}[/]")
    console.print(f"[bold]mtp-bench[/] {label}: {len(work.prompts)} prompts "
                  f"({min(map(len, work.prompts))}-{max(map(len, work.prompts))} tokens, {work.tokenized_with}), "
                  f"max_tokens={args.max_tokens}, K={args.ks}, batches={args.batches}, repeats={args.repeats}, "
                  f"executor={args.executor}, torch threads={torch.get_num_threads()}")  # fmt: skip

    runs: dict[tuple, list[RunResult]] = {}
    plan = [("mtp", k, b) for k in args.ks for b in args.batches] + ([("hf", 0, b) for b in args.batches] if hf else [])
    total = len(plan) * args.repeats + len(args.ks) + (1 if hf else 0) + (1 if ablation else 0)
    progress = Progress(TextColumn("[progress.description]{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)  # fmt: skip
    warm_prompts = work.prompts[:2]
    with progress:
        task = progress.add_task("warm-up", total=total)
        for k, eng in engines.items():  # first calls pay one-off costs (allocation, kernel selection, ORT init)
            progress.update(task, description=f"warm-up K={k}")
            run_engine(eng, warm_prompts, 2, 8, f"warm{k}")
            progress.advance(task)
        if hf:
            progress.update(task, description="warm-up HF")
            hf.run(warm_prompts, 2, 8)
            progress.advance(task)
        for r in range(args.repeats):  # interleaved: every configuration once per round
            for kind, k, b in plan:
                progress.update(task, description=f"round {r + 1} {'HF' if kind == 'hf' else f'K={k}'} batch {b}")
                if kind == "hf":
                    assert hf is not None
                    res = hf.run(work.prompts, b, args.max_tokens)
                else:
                    res = run_engine(engines[k], work.prompts, b, args.max_tokens, f"r{r}k{k}b{b}")
                runs.setdefault((kind, k, b), []).append(res)
                progress.advance(task)
        abl = None
        if ablation is not None:
            progress.update(task, description=f"ablation K={ablation_k} no commit")
            abl = run_engine(ablation, work.prompts, max_b, args.max_tokens, "ablation")
            progress.advance(task)

    # ------------------------------------------------------------------ aggregate
    def med(xs):
        return round(statistics.median(xs), 2)

    tps: dict = {"mtp": {}, "hf": {}}
    for (kind, k, b), rs in runs.items():
        entry = {
            "decode_tps_median": med([x.decode_tps for x in rs]),
            "decode_tps_runs": [round(x.decode_tps, 2) for x in rs],
            "decode_tps_best": round(max(x.decode_tps for x in rs), 2),  # least disturbed by other load
            "e2e_tps_median": med([x.e2e_tps for x in rs]),
            "e2e_tps_runs": [round(x.e2e_tps, 2) for x in rs],
            "generated_tokens": rs[0].total_tokens,
            "wall_seconds_runs": [round(x.wall_seconds, 3) for x in rs],
        }
        if kind == "mtp":
            s = [x.summary for x in rs]
            entry.update({
                "step_time_ms_median": med([x["step_time_ms"] for x in s]),
                "executor_time_ms_median": med([x["executor_time_ms"] for x in s]),
                "host_fraction_median": round(statistics.median([x["host_fraction"] for x in s]), 4),
                "mean_acceptance_length": s[0]["mean_acceptance_length"],
                "num_steps": s[0]["num_steps"],
                "summaries": s,
            })  # fmt: skip
            tps["mtp"].setdefault(str(b), {})[str(k)] = entry
        else:
            tps["hf"][str(b)] = entry
    for b, row in tps["mtp"].items():
        base = row["0"]["decode_tps_median"]
        hf_base = tps["hf"].get(b, {}).get("decode_tps_median")
        for entry in row.values():
            entry["speedup_vs_k0"] = round(entry["decode_tps_median"] / base, 3) if base else None
            entry["speedup_vs_hf"] = round(entry["decode_tps_median"] / hf_base, 3) if hf_base else None
            entry["e2e_speedup_vs_k0"] = round(entry["e2e_tps_median"] / row["0"]["e2e_tps_median"], 3)

    acceptance = {}
    for k in args.ks:
        if k:
            summ = runs[("mtp", k, max_b)][0].summary
            acceptance[f"K={k}"] = {key: summ[key] for key in ("mean_acceptance_length", "acceptance_rate_per_position",
                                                           "conditional_acceptance_per_position")}  # fmt: skip
    if abl is not None:
        acceptance[f"K={ablation_k} no commit pass"] = {
            key: abl.summary[key]
            for key in ("mean_acceptance_length", "acceptance_rate_per_position", "conditional_acceptance_per_position")
        }
        acceptance[f"K={ablation_k} no commit pass"]["decode_tps"] = round(abl.decode_tps, 2)

    # ------------------------------------------------------------------ losslessness
    checks, warnings = {}, []
    for b in args.batches:
        ref = runs[("mtp", 0, b)][0].outputs
        for (kind, k, bb), rs in runs.items():
            if kind != "mtp" or bb != b:
                continue
            for r, res in enumerate(rs):
                bad = first_mismatch(res.outputs, ref)
                checks[f"K={k} batch {b} round {r + 1} == K=0 batch {b}"] = bad if bad else "ok"
                if bad and k:
                    warnings.append(f"K={k} batch {b} round {r + 1}: {len(bad)}/{len(ref)} outputs differ from K=0 "
                                    f"(first at prompt {bad[0]['prompt']}, token {bad[0]['first_diff_at']})")  # fmt: skip
    if abl is not None:
        bad = first_mismatch(abl.outputs, runs[("mtp", 0, max_b)][0].outputs)
        checks[f"K={ablation_k} no commit pass batch {max_b} == K=0"] = bad if bad else "ok"
        if bad:
            warnings.append(f"K={ablation_k} without commit pass: {len(bad)} outputs differ from K=0")
    info_checks = {}
    if len(args.batches) > 1:
        bad = first_mismatch(runs[("mtp", 0, max_b)][0].outputs, runs[("mtp", 0, min(args.batches))][0].outputs)
        info_checks[f"K=0 batch {max_b} == K=0 batch {min(args.batches)}"] = bad if bad else "ok"
    if hf:
        for b in args.batches:
            bad = first_mismatch(runs[("hf", 0, b)][0].outputs, runs[("mtp", 0, 1 if 1 in args.batches else b)][0].outputs)
            info_checks[f"HF batch {b} == K=0"] = bad if bad else "ok"

    # ------------------------------------------------------------------ report
    results = {
        "label": label,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", "runtime.bench", *argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {
            "checkpoint": str(args.checkpoint) if tmp is None else "random (models.testing.tiny_config, seed 0)",
            "executor": args.executor,
            "engine_dir": str(args.engine) if args.executor == "onnxruntime" else None,
            "ks": args.ks, "batches": args.batches, "repeats": args.repeats, "max_tokens": args.max_tokens,
            "num_prompts": len(work.prompts), "prompt_chars": args.prompt_chars, "greedy": True,
            "enable_prefix_caching": False, "max_seq_len": max_seq_len, "hf_transformers": hf.version if hf else None,
        },  # fmt: skip
        "model": {"vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.hidden_size,
                  "num_hidden_layers": model_cfg.num_hidden_layers, "num_mtp_modules": model_cfg.num_mtp_modules,
                  "parameters": _num_params(engines[0])},  # fmt: skip
        "workload": {"files": work.sources, "heldout_from_training": work.heldout, "tokenized_with": work.tokenized_with,
                     "prompt_tokens": [len(p) for p in work.prompts]},  # fmt: skip
        "tokens_per_second": tps,
        "acceptance": acceptance,
        "lossless_checks": checks,
        "reference_checks": info_checks,
        "warnings": warnings,
        "definitions": {
            "decode_tps": "tokens emitted by engine steps with no prefill work / time in those steps "
                          "(HF: tokens after the first / time from the first to the last generated position)",
            "e2e_tps": "all generated tokens / wall time of the run, prefill included",
            "host_fraction": "1 - executor time / step time (scheduling, planning, acceptance, numpy glue)",
            "acceptance_rate_per_position": "accepted at draft position i / proposed at position i",
            "conditional_acceptance_per_position": "P(accept i | positions 0..i-1 accepted)",
            "mean_acceptance_length": "tokens emitted per verify step, bonus token included",
        },
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.output_dir / "bench.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    pngs = plot(results, args.output_dir, label)
    print_tables(console, results, args)
    for w in warnings:
        console.print(f"[bold red]WARNING: not lossless:[/] {w}")
    if not warnings:
        console.print(f"[green]lossless:[/] every MTP output equals K=0 ({len(checks)} comparisons)")
    for name, v in info_checks.items():
        console.print(f"[dim]reference check {name}: {'ok' if v == 'ok' else f'{len(v)} prompts differ'}[/]")
    console.print(f"wrote {json_path}, {', '.join(map(str, pngs))}")
    if tmp is not None:
        tmp.cleanup()
    return 1 if warnings else 0


def _num_params(engine: LLMEngine) -> int | None:
    model = getattr(engine.executor, "model", None)
    return sum(p.numel() for p in model.parameters()) if model is not None else None


def print_tables(console, results: dict, args) -> None:
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
    console.print(t)
    a = Table(title="greedy draft acceptance by position (unconditional / conditional)")
    a.add_column("config")
    a.add_column("accept len", justify="right")
    for i in range(max(args.ks)):
        a.add_column(f"pos {i + 1}", justify="right")
    for name, v in results["acceptance"].items():
        cells = [f"{u:.3f} / {c:.3f}" for u, c in zip(v["acceptance_rate_per_position"],
                                                       v["conditional_acceptance_per_position"], strict=True)]  # fmt: skip
        a.add_row(name, f"{v['mean_acceptance_length']:.2f}", *cells, *[""] * (max(args.ks) - len(cells)))
    console.print(a)


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
