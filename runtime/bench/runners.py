"""mtp-bench runners: the workload and the code that runs it through an engine or through HF `generate`.

Owns the prompt workload (`Workload`: held-out stdlib files, tokenized), the MTP engine runner (`run_engine`,
which splits step time into decode-only and prefill-carrying steps) and the Hugging Face baseline (`HFRunner`).
Each runner returns a `RunResult` (runtime/bench/report.py); runtime/bench/main.py decides what runs when.
"""

from __future__ import annotations

import json
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import ConfigError
from runtime.engine import LLMEngine
from runtime.metrics import Metrics
from runtime.sampling import SamplingParams

# Fallback prompt files when the checkpoint has no training_report.json (relative to the stdlib root).
FALLBACK_FILES = ("json/decoder.py", "textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py",
                  "heapq.py", "glob.py", "string.py", "keyword.py", "queue.py", "sched.py")  # fmt: skip


@dataclass
class RunResult:
    outputs: list[list[int]]
    decode_tokens: int  # tokens emitted by steps with no prefill work in them
    decode_seconds: float
    total_tokens: int
    wall_seconds: float
    summary: dict = field(default_factory=dict)  # Metrics.summary() of the run (engine runs only)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def e2e_tps(self) -> float:
        return self.total_tokens / self.wall_seconds if self.wall_seconds else 0.0


# ----------------------------------------------------------------------------------------------- workload


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids (what both the engine and HF get)
    sources: list[str]  # stdlib-relative file names
    texts: list[str]  # the prompt text (before tokenization)
    tokenized_with: str  # "tokenizer.json" or "bytes % vocab" (no tokenizer)
    heldout: bool  # the files are known to be held out of training


def heldout_files(checkpoint: Path, n: int) -> tuple[list[Path], bool]:
    """n held-out stdlib files, deterministic: the report's held-out list, else training.train's split rule."""
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
            from models.training.data import split_files, stdlib_files

            candidates = split_files(stdlib_files(root))[1]
            heldout = bool(candidates)  # same rule training.train uses, on the same Python install
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


@dataclass
class BenchSetup:
    label: str  # names the model in titles and bench.json ("RANDOM untrained tiny model" for --random)
    workload: Workload
    engines: dict[int, LLMEngine]  # K -> engine with the commit pass; K=0 (plain decoding) is always present
    ablation: LLMEngine | None  # K=ablation_k without the commit pass; None when the largest K is 0
    ablation_k: int | None
    hf: HFRunner | None  # None with --no-hf or when transformers cannot load the checkpoint
    max_seq_len: int  # the KV table width the engines actually use (the ORT engine dir may override ours)
    tmp: tempfile.TemporaryDirectory | None  # holds the --random checkpoint until the report is written

    @property
    def is_random(self) -> bool:
        return self.tmp is not None
