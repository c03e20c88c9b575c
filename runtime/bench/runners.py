"""mtp-bench runners: the workload and the code that runs it through an engine or through HF `generate`.

Owns the prompt workload (`Workload`: held-out stdlib files, tokenized), the MTP engine runner (`run_engine`,
which splits step time into decode-only and prefill-carrying steps), the Hugging Face baseline (`HFRunner`:
plain `generate` and `generate(use_mtp=True)`) and `RunResult`, what every runner returns (the llama.cpp
runner too, runtime/bench/llama_cpp.py). runtime/bench/setup.py decides what runs, main.py when.
"""

from __future__ import annotations

import json
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.core.config import ConfigError
from runtime.core.engine import LLMEngine
from runtime.core.sampling import SamplingParams

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
    decode_steps: int = 0  # target-model forwards (verify steps) in the decode-only time
    texts: list[str] | None = None  # llama.cpp: decoded text instead of ids (outputs is empty then)
    decode_cpu_seconds: float = 0.0  # process CPU time of the decode-only steps (runtime/bench/auto_guard.py)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def decode_cpu_tps(self) -> float:
        return self.decode_tokens / self.decode_cpu_seconds if self.decode_cpu_seconds else 0.0

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


def heldout_files(checkpoint: Path, n: int | None) -> tuple[list[Path], bool]:
    """n held-out stdlib files (None: all usable ones), deterministic: the report's held-out list, else
    training.train's split rule."""
    root = Path(sysconfig.get_paths()["stdlib"])
    report = checkpoint / "training_report.json"
    candidates: list[Path] = []
    heldout = False
    if report.is_file():
        paths = json.loads(report.read_text()).get("corpus", {}).get("heldout_paths", [])
        candidates = [root / p for p in paths if (root / p).is_file()]
        heldout = bool(candidates)
    if not candidates:
        from models.training.data import split_files, stdlib_files

        candidates = split_files(stdlib_files(root))[1]
        heldout = bool(candidates)  # same rule training.train uses, on the same Python install
    if not candidates:
        candidates = [root / f for f in FALLBACK_FILES if (root / f).is_file()]
    # Skip near-empty files (e.g. bare __init__.py) and spread the pick over the whole list.
    candidates = [p for p in candidates if p.stat().st_size >= 400]
    if n is None:
        return candidates, heldout
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
    """Run prompts together to completion; split time into decode-only steps and steps carrying prefill (the
    times are the engine's step records': runtime/core/step_record.py)."""
    ids = [engine.add_request(p, params, req_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    finals: dict[str, list[int]] = {}
    dec_tokens = total = dec_steps = 0
    dec_seconds = dec_cpu = 0.0
    while engine.has_unfinished():
        decode_only = not engine.awaiting_first_token(ids)  # nothing left to prefill
        outs = engine.step()
        n = sum(len(o.new_token_ids) for o in outs)
        total += n
        if decode_only and (record := engine.last_step) is not None:
            dec_tokens += n
            dec_seconds += record.total_seconds
            dec_cpu += record.cpu_seconds
            dec_steps += 1
        for o in outs:
            if o.finished:
                finals[o.req_id] = o.output_ids
    return [finals[i] for i in ids], dec_tokens, dec_seconds, total, dec_steps, dec_cpu


def run_engine(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int, tag: str) -> RunResult:
    """batch 1: one request at a time; batch B: B requests in flight together (continuous batching)."""
    engine.reset_metrics()  # fresh counters per run
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs: list[list[int]] = []
    dec_tokens = total = steps = 0
    dec_seconds = dec_cpu = 0.0
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), batch):
        outs, dt, ds, tt, st, dc = _drive(engine, prompts[lo : lo + batch], params, f"{tag}-{lo}")
        outputs += outs
        dec_tokens, dec_seconds, total, steps = dec_tokens + dt, dec_seconds + ds, total + tt, steps + st
        dec_cpu += dc
    wall = time.perf_counter() - t0
    engine.kv.assert_no_leaks()
    summary = engine.metrics.summary(wall, len(prompts))
    return RunResult(outputs, dec_tokens, dec_seconds, total, wall, summary, decode_steps=steps,
                     decode_cpu_seconds=dec_cpu)


# ----------------------------------------------------------------------------------------------- HF runs


class HFRunner:
    """transformers `Glm4MoeForCausalLM.generate`, greedy; batch > 1 uses left padding + attention mask.

    run_mtp: `generate(use_mtp=True)`, transformers' own MTP speculative decoding (batch 1: assisted
    generation takes one sequence; K = the checkpoint's MTP module count, i.e. 1 for ours).
    """

    def __init__(self, checkpoint: Path, eos: tuple[int, ...]) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()  # generate(use_mtp) loads the MTP module per call
        self.torch = torch
        self.model = transformers.Glm4MoeForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        # transformers finds the MTP weights through this list, whose defaults name only GLM-4.5's layer
        # counts (46, 92); ours sits right after the main layers (docs/MTP_HIDDEN_STATES.md).
        n = self.model.config.num_hidden_layers
        self.model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
        self.mtp_k = int(getattr(self.model.config, "num_nextn_predict_layers", 0) or 0)
        self.eos = list(eos)
        self.version = transformers.__version__

    def run_mtp(self, prompts: list[list[int]], max_tokens: int) -> RunResult:
        """One prompt at a time; decode time from the streamer's per-step stamps, acceptance from the generator."""
        from transformers.generation.candidate_generator import MTPCandidateGenerator
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        matches: list[int] = []
        original = MTPCandidateGenerator.update_candidate_strategy

        def record(gen, input_ids, scores, num_matches):  # instrumentation only: counts, then defers
            matches.append(int(num_matches))
            return original(gen, input_ids, scores, num_matches)

        class Stamps(BaseStreamer):  # put() once with the prompt, then once per verify step
            def __init__(self) -> None:
                self.at: list[tuple[float, int]] = []

            def put(self, value) -> None:
                self.at.append((time.perf_counter(), int(value.numel())))

            def end(self) -> None:
                pass

        outputs: list[list[int]] = []
        dec_tokens = total = steps_n = 0
        dec_seconds = 0.0
        per_step: list[int] = []
        t_start = time.perf_counter()
        setattr(MTPCandidateGenerator, "update_candidate_strategy", record)  # noqa: B010 - restored below
        try:
            for p in prompts:
                st, first = Stamps(), len(matches)
                with torch.no_grad():
                    out = self.model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                              use_mtp=True, eos_token_id=self.eos or None, pad_token_id=0,
                                              streamer=st)  # fmt: skip
                row = out[0, len(p) :].tolist()
                cut = next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
                outputs.append(row[:cut])
                total += len(outputs[-1])
                steps = st.at[2:]  # [0] is the prompt, [1] the token of the prefill forward
                if steps:
                    dec_tokens += sum(n for _, n in steps)
                    dec_seconds += steps[-1][0] - st.at[1][0]
                    steps_n += len(steps)
                per_step += matches[first + 1 :]  # the first call follows the prefill (no draft yet)
        finally:
            setattr(MTPCandidateGenerator, "update_candidate_strategy", original)  # noqa: B010
        wall = time.perf_counter() - t_start
        summary = acceptance_summary(per_step, max(self.mtp_k, 1))
        return RunResult(outputs, dec_tokens, dec_seconds, total, wall, summary, decode_steps=steps_n)

    def run(self, prompts: list[list[int]], batch: int, max_tokens: int) -> RunResult:
        torch = self.torch
        outputs: list[list[int]] = []
        dec_tokens = total = steps = 0
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
                steps += len(stamps) - 1
        wall = time.perf_counter() - t_start
        return RunResult(outputs, dec_tokens, dec_seconds, total, wall, decode_steps=steps)


def acceptance_summary(accepted_per_step: list[int], k: int) -> dict:
    """Metrics.summary()'s acceptance keys from a list of accepted-draft counts per verify step (HF, llama.cpp)."""
    n = len(accepted_per_step)
    return rates_summary([sum(a > i for a in accepted_per_step) / n if n else 0.0 for i in range(k)], n)


def rates_summary(uncond: list[float], steps: int) -> dict:
    """Acceptance keys from unconditional per-position rates: mean length = 1 + sum of P(accepted >= i)."""
    prev = [1.0, *uncond[:-1]]
    cond = [u / p if p else 0.0 for u, p in zip(uncond, prev, strict=True)]
    return {"mean_acceptance_length": round(1 + sum(uncond), 3),
            "acceptance_rate_per_position": [round(x, 3) for x in uncond],
            "conditional_acceptance_per_position": [round(x, 3) for x in cond], "num_steps": steps}  # fmt: skip


def warm_up(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """One short untimed run (allocation, kernel selection, the first call of every compiled graph), then a
    fresh `auto` controller: the warm-up's one-off costs are not what a draft length costs (the first calls
    of the compiled draft graphs made k > 0 look slow, and auto then gave up drafting at batch 1, 1.0x of K=0
    instead of 1.3-1.7x)."""
    run_engine(engine, prompts[:2], 2, 8, "warm")
    if engine.draft_length is not None:
        engine.draft_length.forget()
