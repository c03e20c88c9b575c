"""mtp-bench setup: the checkpoint, the engines of every configuration, the peers, and the timed plan.

Owns turning the parsed CLI into a `BenchSetup`: the checkpoint (or a random one), the workload, our engines
(one per executor and K, plus the no-commit-pass ablation), HF `generate` (plain and `use_mtp=True`),
llama.cpp (when `make bench-peers` built it), and the list of `Entry`s the measurement loop times round by
round. A peer that cannot run here is skipped with a one-line note (recorded in bench.json), never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from models.engine_format.layout import cdiv
from runtime.bench.llama_cpp import LlamaCppError, LlamaCppRunner
from runtime.bench.runners import HFRunner, RunResult, Workload, make_workload, run_engine, warm_up
from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.engine import LLMEngine
from runtime.factory import create_engine, load_tokenizer

DEFAULT_LLAMA_SRC = Path("build/peers/llama_cpp_python-0.3.36/vendor/llama.cpp")
DEFAULT_LLAMA_BIN = Path("build/peers/llama-build/bin")


@dataclass
class Entry:
    """One timed configuration: engine name ("torch", "onnxruntime", "compiled", "hf", "llama.cpp"), K (str), batch."""

    engine: str
    k: str
    batch: int
    run: Callable[[], RunResult]

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.engine, self.k, self.batch)

    @property
    def name(self) -> str:
        return f"{self.engine} K={self.k} batch {self.batch}"


@dataclass
class BenchSetup:
    label: str  # names the model in titles and bench.json ("RANDOM untrained tiny model" for --random)
    workload: Workload
    engines: dict[tuple[str, str], LLMEngine]  # (executor, K) -> engine with the commit pass
    plan: list[Entry]  # every timed configuration, in round order
    warmups: list[tuple[str, Callable[[], object]]]  # one-off costs kept out of the timed rounds
    ablation: Entry | None  # the largest K without the commit pass (first executor, largest batch)
    hf: HFRunner | None
    max_seq_len: int  # the KV table width our engines use
    tmp: tempfile.TemporaryDirectory | None  # holds the --random checkpoint until the report is written
    notes: list[str] = field(default_factory=list)  # why something was skipped (printed and in bench.json)
    llama: dict = field(default_factory=dict)  # llama.cpp binaries/gguf/commands when it runs
    llama_runner: LlamaCppRunner | None = None

    @property
    def is_random(self) -> bool:
        return self.tmp is not None

    @property
    def model_cfg(self):
        return next(iter(self.engines.values())).model_cfg


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


def token_budget(max_batch: int, max_k: int) -> int:
    """Packed rows per step for the bench's engines: a full decode batch at the largest K, and at least
    RuntimeConfig's default budget so prefill chunks stay the size the engine normally runs."""
    return max(RuntimeConfig().max_num_tokens, max_batch * (1 + max_k))


def ensure_engine_dir(args, max_k: int, max_batch: int, console) -> None:
    """Build --engine with mtp-build when it is missing or too small for the largest K and batch."""
    from models.engine_format import EngineDirError, load_engine_config
    from models.engine_format.compiled import compiled_problem

    engine_dir = args.engine
    try:
        ecfg = load_engine_config(engine_dir)
        compiled = "compiled" not in args.executors or compiled_problem(ecfg) is None
        onnx = "onnxruntime" not in args.executors or ecfg.onnx_weights
        ok = ecfg.num_draft_tokens >= max_k and ecfg.limits.max_batch >= max_batch and compiled and onnx
        why = (f"built for K={ecfg.num_draft_tokens}, max_batch={ecfg.limits.max_batch}"
               + ("" if compiled else ", no runnable compiled packages") + ("" if onnx else ", no ONNX weights"))  # fmt: skip
    except (EngineDirError, FileNotFoundError) as e:
        ok, why = False, (str(e).splitlines()[0] if engine_dir.exists() else "missing")
    if not ok:
        console.print(f"[yellow]building {engine_dir} ({why}) with K={max_k}, max_batch={max_batch}[/]")
        from builder.cli import main as build_main

        rc = build_main(["--checkpoint", str(args.checkpoint), "--output", str(engine_dir), "--num-draft-tokens",
                         str(max_k), "--max-batch", str(max_batch), "--max-num-tokens",
                         str(token_budget(max_batch, max_k)), "--force",
                         "--compile", "aoti" if "compiled" in args.executors else "none",
                         *(["--keep-onnx"] if {"compiled", "onnxruntime"} <= set(args.executors) else [])])  # fmt: skip
        if rc != 0:
            raise ConfigError(f"mtp-build failed for {engine_dir} (exit {rc})")


def engine_factory(args, work: Workload) -> Callable[..., LLMEngine]:
    """engine_for(executor, k, commit_pass=True), sized for the largest K and batch, prefix caching off."""
    max_k, max_b = max(args.int_ks), max(args.batches)
    block = RuntimeConfig().block_size  # the torch engine's block size; the table width is what attention scans
    longest = max(map(len, work.prompts)) + args.max_tokens + 2 * max_k + 1
    max_seq_len = args.max_seq_len or cdiv(longest, block) * block

    owners: dict[str, LLMEngine] = {}  # per executor: the engine whose executor (weights, pool) all K share

    def make(executor: str, num_draft: int | str, commit_pass: bool, owner: LLMEngine | None) -> LLMEngine:
        common = dict(num_draft_tokens=num_draft, max_batch=max_b, commit_pass=commit_pass, share_executor_of=owner,
                      enable_prefix_caching=False, max_num_tokens=token_budget(max_b, max_k))  # fmt: skip
        if executor == "onnxruntime":
            return create_engine(args.engine, args.checkpoint, "onnxruntime", threads=args.threads, **common)
        if executor == "compiled":
            return create_engine(args.engine, args.checkpoint, "compiled", **common)
        return create_engine(None, args.checkpoint, "torch", max_seq_len=max_seq_len, **common)

    def engine_for(executor: str, k: str, commit_pass: bool = True) -> LLMEngine:
        # every K runs on one executor per kind: separate copies of the same weights measured up to 19% apart
        # from memory placement alone (three identical K=0 engines, one process), more than K differences
        if executor not in owners:
            owners[executor] = make(executor, max_k, True, None)  # sized for the largest K
        return make(executor, k if k in ("auto", "per-request") else int(k), commit_pass, owners[executor])

    return engine_for


def _load_hf(args, eos: tuple[int, ...], notes: list[str]) -> HFRunner | None:
    if args.no_hf:
        return None
    try:
        return HFRunner(args.checkpoint, eos)
    except Exception as e:  # noqa: BLE001 - the HF baseline is optional
        notes.append(f"HF generate skipped: {str(e).splitlines()[0]}")
        return None


def _load_llama(args, ctx: int, notes: list[str]) -> LlamaCppRunner | None:
    """The llama.cpp runner, converting the checkpoint to GGUF first when needed; None (with a note) if it can't."""
    from runtime.bench.gguf import gguf_path

    if args.no_llama_cpp:
        return None
    if not (args.checkpoint / "tokenizer.json").is_file():
        notes.append("llama.cpp skipped: the checkpoint has no tokenizer.json (llama.cpp takes text prompts)")
        return None
    gguf = gguf_path(args.checkpoint)
    if not gguf.is_file() and (args.llama_src / "convert_hf_to_gguf.py").is_file():
        p = subprocess.run([sys.executable, "-m", "runtime.bench.gguf", "--checkpoint", str(args.checkpoint),
                            "--llama-src", str(args.llama_src)], capture_output=True, text=True, check=False)  # fmt: skip
        if p.returncode != 0:
            notes.append(f"llama.cpp skipped: GGUF conversion failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
            return None
    try:
        return LlamaCppRunner(args.llama_cpp, gguf, args.threads, ctx)
    except LlamaCppError as e:
        notes.append(f"llama.cpp skipped: {e}")
        return None


def _first(fn: Callable[..., tuple], *a) -> RunResult:
    return fn(*a)[0]


def make_setup(args, console) -> BenchSetup:
    """Everything the timed rounds need, in the order: checkpoint, engines, HF, llama.cpp, plan."""
    tmp, label = resolve_checkpoint(args)
    max_k, max_b = max(args.int_ks), max(args.batches)
    if set(args.executors) & {"onnxruntime", "compiled"}:
        if args.engine is None:
            raise ConfigError("the onnxruntime and compiled executors need --engine DIR (built when missing); or pass "
                              "--executors torch")
        ensure_engine_dir(args, max_k, max_b, console)
    vocab_size = int(json.loads((args.checkpoint / "config.json").read_text())["vocab_size"])
    tokenizer = load_tokenizer(args.checkpoint)
    work = make_workload(args.checkpoint, args.num_prompts, args.prompt_chars, vocab_size, tokenizer)
    engine_for = engine_factory(args, work)
    notes: list[str] = []
    engines: dict[tuple[str, str], LLMEngine] = {}
    for ex in args.executors:
        for k in args.ks:
            try:
                engines[(ex, k)] = engine_for(ex, k)
            except Exception as e:  # noqa: BLE001 - only "auto" may be refused; a numeric K failing is a real error
                if k != "auto":
                    raise
                notes.append(f"K=auto skipped on {ex}: the engine refused num_draft_tokens='auto' "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'})")  # fmt: skip
    first = engines[(args.executors[0], "0")]
    if first.model_cfg.num_mtp_modules == 0:
        raise ConfigError(f"{args.checkpoint} has no MTP module: nothing to benchmark against K=0")
    prompts, mt = work.prompts, args.max_tokens
    # partial, not lambdas in loops: each entry must bind its own engine / batch / K
    plan = [Entry(ex, k, b, partial(run_engine, eng, prompts, b, mt, f"{ex}{k}b{b}"))
            for (ex, k), eng in engines.items() for b in args.batches]  # fmt: skip
    warmups: list[tuple[str, Callable[[], object]]] = [
        (f"{ex} K={k}", partial(warm_up, eng, prompts)) for (ex, k), eng in engines.items()
    ]
    ablation = None
    if max_k > 0:
        abl = engine_for(args.executors[0], str(max_k), commit_pass=False)
        ablation = Entry(args.executors[0], f"{max_k} no commit pass", max_b,
                         lambda: run_engine(abl, prompts, max_b, mt, "ablation"))  # fmt: skip
    hf = _load_hf(args, first.model_cfg.eos_token_id, notes)
    if hf is not None:
        plan += [Entry("hf", "0", b, partial(hf.run, prompts, b, mt)) for b in args.batches]
        warmups.append(("HF generate", lambda: hf.run(prompts[:2], 2, 8)))
        if 1 in args.batches and hf.mtp_k:
            plan.append(Entry("hf", str(hf.mtp_k), 1, lambda: hf.run_mtp(prompts, mt)))
            warmups.append(("HF use_mtp", lambda: hf.run_mtp(prompts[:1], 8)))
        elif hf.mtp_k:
            notes.append("HF generate(use_mtp=True) skipped: it runs batch 1 only and 1 is not in --batches")
    llama_info: dict = {}
    llama = _load_llama(args, first.cfg.max_seq_len + 64, notes) if 1 in args.batches else None
    if llama is not None:
        for k in [0, *args.llama_ks]:
            plan.append(Entry("llama.cpp", str(k), 1, partial(_first, llama.run, work.texts, k, mt)))
        warmups.append(("llama.cpp", lambda: llama.run(work.texts[:1], max(args.llama_ks, default=0), 8)))
        llama_info = {"bin_dir": str(args.llama_cpp), "gguf": str(llama.gguf), "threads": args.threads,
                      "commands": {str(k): llama.command("<prompt>", k, mt) for k in [0, *args.llama_ks]}}  # fmt: skip
    return BenchSetup(label, work, engines, plan, warmups, ablation, hf, first.cfg.max_seq_len, tmp, notes, llama_info,
                      llama)  # fmt: skip
