"""The llama.cpp runner: the same prompts through llama.cpp's own binaries on the GGUF of the same checkpoint.

`make bench-peers` builds the binaries (the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist, which
has GLM-4.5 MTP) and writes the GGUF (runtime/bench/gguf.py). Plain decoding runs `llama-completion`;
MTP speculative decoding runs `llama-speculative-simple --spec-type draft-mtp --spec-draft-n-max K`
(`--spec-draft-p-min 0`: always draft K, as ours does). One process per prompt, batch 1, greedy
(`--temp 0 --top-k 1`), `-t/-tb` = the bench's thread count.

Timings are llama.cpp's own, model load excluded: plain decode = `eval time` + `sampling time` over the
eval runs (`common_perf_print`); MTP decode = the `decoded N tokens in S seconds` line (everything after
the prompt). Acceptance comes from the draft statistics line (`#acc rate/pos`, printed at `-lv 4`).
Outputs are text (llama.cpp prints pieces, not ids); the bench compares them with our decoded K=0 text.
Parsing is `parse_completion` / `parse_speculative`, pure functions of the captured output.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from runtime.bench.runners import RunResult, rates_summary

PLAIN_BIN, SPEC_BIN = "llama-completion", "llama-speculative-simple"
TIMEOUT_S = 300  # per prompt; a tiny model takes well under a second
LOST_LOG_RETRIES = 3  # see LlamaCppRunner.run_one


class LlamaCppError(RuntimeError):
    """llama.cpp failed or printed something the parser does not understand (one line, with the command)."""


@dataclass
class LlamaOutput:
    """What one llama.cpp process reported for one prompt."""

    text: str
    prompt_tokens: int
    decode_tokens: int
    decode_seconds: float
    prompt_seconds: float
    steps: int  # target-model forwards in the decode phase (verify steps for MTP)
    accepted_per_pos: list[float] = field(default_factory=list)  # MTP: accepted at position i / verify steps
    generated: int = 0  # tokens generated in all (MTP: includes the eos token, like our output_ids)


def _num(pattern: str, text: str, what: str, cast=float):
    m = re.search(pattern, text)
    if m is None:
        raise LlamaCppError(f"llama.cpp output has no {what} line (pattern {pattern!r})")
    return cast(m.group(1))


def parse_completion(stdout: str, stderr: str) -> LlamaOutput:
    """llama-completion --no-display-prompt: stdout is the generated text (+ " [end of text]\\n" at eos) + "\\n\\n"."""
    log = stdout + "\n" + stderr
    eval_ms = _num(r"(?<!prompt )eval time =\s*([\d.]+) ms", log, "eval time")
    runs = _num(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) runs", log, "eval runs", int)
    sampling_ms = _num(r"sampling time =\s*([\d.]+) ms", log, "sampling time")
    prompt_ms = _num(r"prompt eval time =\s*([\d.]+) ms", log, "prompt eval time")
    prompt_tokens = _num(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", log, "prompt tokens", int)
    text = stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    return LlamaOutput(text, prompt_tokens, runs, (eval_ms + sampling_ms) / 1e3, prompt_ms / 1e3, runs,
                       generated=runs + 1)  # fmt: skip


def parse_speculative(stdout: str, stderr: str, prompt_text: str) -> LlamaOutput:
    """llama-speculative-simple: stdout is "\\n\\n" + prompt pieces + generated text + "\\n\\n" * 2; stats on stderr.

    It stops once it has more than -n tokens and a verify step may add up to K + 1, so the text can run a few
    tokens past max_tokens (the bench compares our text as a prefix of it).
    """
    log = stdout + "\n" + stderr
    n_in = _num(r"encoded\s+(\d+) tokens in", log, "encoded", int)
    enc_s = _num(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log, "encode time")
    n_dec = _num(r"decoded\s+(\d+) tokens in", log, "decoded", int)
    dec_s = _num(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log, "decode time")
    calls = _num(r"#calls\(b,g,a\) =\s*\d+\s+\d+\s+(\d+)", log, "draft statistics (-lv 4)", int)
    m = re.search(r"#acc rate/pos = \(([^)]*)\)", log)
    per_pos = [float(x) for x in m.group(1).split(",")] if m else []
    body = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not body.startswith(prompt_text):
        raise LlamaCppError("llama-speculative-simple did not echo the prompt as given (its tokenization differs)")
    return LlamaOutput(body[len(prompt_text) :], n_in, n_dec, dec_s, enc_s, calls, per_pos, generated=n_dec)


class LlamaCppRunner:
    """Runs prompts (as text) through llama.cpp; plain when k == 0, draft-mtp with k drafts otherwise."""

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, ctx: int) -> None:
        self.bin_dir, self.gguf, self.threads, self.ctx = bin_dir, gguf, threads, ctx
        self.retries = 0  # runs repeated because llama.cpp's log lost its tail (recorded in bench.json)
        missing = [b for b in (PLAIN_BIN, SPEC_BIN) if not (bin_dir / b).is_file()]
        if missing:
            raise LlamaCppError(f"{', '.join(missing)} not in {bin_dir}; run `make bench-peers`")
        if not gguf.is_file():
            raise LlamaCppError(f"{gguf} missing; run `make bench-peers` (python -m runtime.bench.gguf)")
        # One thread never spins on a barrier, but more would: OpenMP's active wait made every step 10-100x
        # slower on the shared 2-core machine (docs/BENCHMARKS.md, "Threads"), so waiting is passive.
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}

    def command(self, prompt_text: str, k: int, max_tokens: int) -> list[str]:
        common = ["-m", str(self.gguf), "-p", prompt_text, "--no-escape", "--temp", "0", "--top-k", "1", "--seed", "0",
                  "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.ctx), "-ngl", "0"]  # fmt: skip
        if k == 0:
            return [str(self.bin_dir / PLAIN_BIN), *common, "-n", str(max_tokens), "-no-cnv", "--no-display-prompt",
                    "--simple-io"]  # fmt: skip
        # speculative-simple stops once it has generated more than -n tokens, i.e. -n + 1 of them
        return [str(self.bin_dir / SPEC_BIN), *common, "-n", str(max_tokens - 1), "--spec-type", "draft-mtp",
                "--spec-draft-n-max", str(k), "--spec-draft-p-min", "0", "-lv", "4"]  # fmt: skip

    def run_one(self, prompt_text: str, k: int, max_tokens: int) -> LlamaOutput:
        """One process. llama.cpp logs through a leaked asynchronous logger that can lose its last lines at
        exit (common/log.cpp says so); the queue is FIFO, so when the statistics lines arrived everything
        before them did too, and a run whose tail was lost is simply run again."""
        cmd = self.command(prompt_text, k, max_tokens)
        for attempt in range(LOST_LOG_RETRIES + 1):
            try:
                p = subprocess.run(cmd, capture_output=True, env=self.env, timeout=TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired as e:
                raise LlamaCppError(f"{Path(cmd[0]).name} ran over {TIMEOUT_S}s") from e
            out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
            if p.returncode != 0:
                last = (err.strip().splitlines() or ["(no output)"])[-1]
                raise LlamaCppError(f"{Path(cmd[0]).name} exited {p.returncode}: {last}")
            try:
                return parse_completion(out, err) if k == 0 else parse_speculative(out, err, prompt_text)
            except LlamaCppError:
                if attempt == LOST_LOG_RETRIES:
                    raise
            self.retries += 1
        raise AssertionError("unreachable")

    def run(self, texts: list[str], k: int, max_tokens: int) -> tuple[RunResult, list[LlamaOutput]]:
        """All prompts one at a time; the RunResult's outputs are empty (texts are in the LlamaOutputs)."""
        outs = [self.run_one(t, k, max_tokens) for t in texts]
        dec_tokens = sum(o.decode_tokens for o in outs)
        dec_seconds = sum(o.decode_seconds for o in outs)
        total = sum(o.generated for o in outs)
        wall = sum(o.decode_seconds + o.prompt_seconds for o in outs)  # llama.cpp's own timers, load excluded
        steps = sum(o.steps for o in outs)
        summary: dict = {"num_steps": steps}
        if k:
            # per-prompt rates weighted by that prompt's verify steps = pooled accepted-at-i / steps
            pooled = [sum(o.accepted_per_pos[i] * o.steps for o in outs if len(o.accepted_per_pos) > i) / max(steps, 1)
                      for i in range(k)]  # fmt: skip
            summary = rates_summary(pooled, steps)
        summary["prompt_tokens"] = [o.prompt_tokens for o in outs]  # checked against our tokenizer's counts
        texts = [o.text for o in outs]
        return RunResult([], dec_tokens, dec_seconds, total, wall, summary, steps, texts), outs

