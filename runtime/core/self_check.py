"""The start-up acceptance self-check: draft on the built-in repetitive prompts, judge the acceptance.

Runs greedy requests through the engine's own step (the wiring under test is the real one: verify, commit pass,
draft loop, executor), reads the per-position counts from the engine's metrics and leaves the metrics fresh for
what follows. The verdict is `acceptance_guard.evaluate_self_check`, a pure function of those counts. Greedy
requests change nothing later requests see (verification is lossless; the prefix cache may keep their blocks).
"""

from __future__ import annotations

import sys
import time

from runtime.core.acceptance_guard import (
    CHECK_MODES,
    SELF_CHECK_MAX_TOKENS,
    SelfCheckResult,
    evaluate_self_check,
    self_check_prompts,
)
from runtime.core.config import ConfigError
from runtime.core.engine import LLMEngine
from runtime.core.ranks import SINGLE_RANK
from runtime.core.sampling import SamplingParams


def run_self_check(engine: LLMEngine) -> tuple[SelfCheckResult, float] | None:
    """The verdict and the check's wall seconds; None when there is nothing to check (no MTP, K = 0) or the engine
    is one rank of an mpirun job (its peers would have to step the same requests in lockstep)."""
    if engine.k == 0 or engine.ranks is not SINGLE_RANK:
        return None
    t0 = time.perf_counter()
    longest = max(1, engine.cfg.max_seq_len - SELF_CHECK_MAX_TOKENS)
    prompts = [p[-longest:] for p in self_check_prompts(engine.tokenizer, engine.model_cfg.vocab_size)]
    engine.reset_metrics()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=SELF_CHECK_MAX_TOKENS))
    m = engine.metrics
    result = evaluate_self_check(list(m.proposed_per_position), list(m.accepted_per_position))
    engine.reset_metrics()  # the served statistics (and the running detector) start after the check
    return result, time.perf_counter() - t0


def start_up_check(engine: LLMEngine, mode: str, prog: str) -> SelfCheckResult | None:
    """The applications' start-up step (`--acceptance-check warn|strict|off`): run the check; when acceptance is
    implausibly low print one line on stderr (warn) or raise ConfigError with it (strict)."""
    if mode not in CHECK_MODES:
        raise ConfigError(f"--acceptance-check {mode!r}: choose one of {', '.join(CHECK_MODES)}")
    ran = None if mode == "off" else run_self_check(engine)
    if ran is None:
        return None
    result, _ = ran
    if result.verdict == "low":
        if mode == "strict":
            raise ConfigError(result.line(prog).replace(": warning:", ":", 1))
        print(result.line(prog), file=sys.stderr, flush=True)
    return result
