"""One engine step's record: what the step did and what each phase cost, filled while it runs.

The engine publishes one `StepRecord` per step (`LLMEngine.last_step`, and every callable in
`LLMEngine.step_listeners`), and every consumer of step statistics reads it instead of timing the step itself:
`Metrics.record_step` (counters), `CycleMeter` (the cost cycles `--num-draft-tokens auto` learns from), the bench
runners (decode time) and the serving statistics. A record is never changed after it is published.

`StepTimer` does the timing (runtime/core/engine.py's `_step` calls `lap` after each phase), so the step itself
reads as its phases. Phase seconds are wall time (time.perf_counter); the step and its draft phase are also
measured on the engine's `draft_clock` (auto's clock: wall time, or process time for CPU executors).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The phases of a step in the order they run (docs/RUNTIME.md, "One step"); an idle step has only "schedule".
PHASES = ("schedule", "verify", "accept", "plan", "commit", "apply", "draft", "publish")


@dataclass(slots=True)
class StepRecord:
    phase_seconds: dict[str, float] = field(default_factory=dict)  # wall seconds of each phase that ran
    total_seconds: float = 0.0  # wall seconds of the whole step (>= the sum of its phases)
    executor_seconds: float = 0.0  # wall seconds inside executor calls (main, commit, draft)
    cpu_seconds: float = 0.0  # process CPU seconds of the step (the bench's CPU-time figures)
    clock_seconds: float = 0.0  # the whole step on the engine's draft_clock
    clock_draft_seconds: float = 0.0  # the draft phase on the engine's draft_clock
    num_scheduled: int = 0  # requests this step forwarded (0: an idle step)
    num_preemptions: int = 0
    main_rows: int = 0  # packed rows of the verify (main) forward
    commit_rows: list[int] = field(default_factory=list)  # rows of each commit call
    draft_rows: list[int] = field(default_factory=list)  # live rows of each draft depth (0: a padded depth)
    draft_depths: int = 0  # the draft loop's depths k (fixed K, auto's pick, or the deepest k_i; run if drafting)
    num_drafting: int = 0  # requests that draft after this step (k = 0 chosen included: counted, not run)
    k_per_request: dict[str, int] = field(default_factory=dict)  # req_id -> drafts it makes for its next verify
    proposed_per_request: dict[str, int] = field(default_factory=dict)  # decode verifies: drafts verified
    accepted_per_request: dict[str, int] = field(default_factory=dict)  # ... and how many of them were accepted
    num_generated_tokens: int = 0  # output tokens this step appended (all requests, aborted ones included)


class StepTimer:
    """Times one step into a fresh StepRecord: `lap(phase)` closes the phase that ran since the previous lap."""

    __slots__ = ("record", "_clock", "_start", "_last", "_clock_start", "_clock_draft", "_cpu_start")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.record = StepRecord()
        self._clock = clock
        self._start = self._last = time.perf_counter()
        self._clock_start = clock()
        # the CPU clock is read apart only when the draft clock is another one (each read costs ~1 us)
        self._cpu_start = self._clock_start if clock is time.process_time else time.process_time()
        self._clock_draft = 0.0

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.record.phase_seconds[phase] = now - self._last
        self._last = now
        if phase == "apply":  # the draft phase is what auto's cycle splits at: it also runs on the draft clock
            self._clock_draft = self._clock()
        elif phase == "draft":
            self.record.clock_draft_seconds = self._clock() - self._clock_draft

    def executor(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call an executor method, adding its time to the step's executor time."""
        t0 = time.perf_counter()
        out = fn(*args)
        self.record.executor_seconds += time.perf_counter() - t0
        return out

    def finish(self) -> StepRecord:
        r = self.record
        r.total_seconds = time.perf_counter() - self._start
        r.clock_seconds = self._clock() - self._clock_start
        r.cpu_seconds = r.clock_seconds if self._clock is time.process_time else time.process_time() - self._cpu_start
        return r


class CycleMeter:
    """auto's cost samples from the step records (runtime/core/draft_length.py, StepSample): the cost of a draft
    length is a cycle, the draft loop that made k drafts plus the next step but its own draft loop."""

    __slots__ = ("_prev", "_cycle")

    def __init__(self) -> None:
        self._prev = (0.0, 0.0, 0.0)  # the previous step's draft loop: (draft-clock seconds, depths, requests)
        self._cycle = (0.0, 0.0, 0.0, 0.0)  # the last finished cycle: (seconds, depths, requests, verify rows)

    def close(self, r: StepRecord) -> None:
        """A (non-idle) step ended: it finishes the previous step's cycle and opens its own."""
        seconds, depths, drafting = self._prev
        self._cycle = (seconds + r.clock_seconds - r.clock_draft_seconds, depths, drafting, float(r.main_rows))
        self._prev = (r.clock_draft_seconds, float(r.draft_depths), float(r.num_drafting))

    def take(self) -> tuple[float, float, float, float]:
        """The last finished cycle, reported once (zeros after that)."""
        cycle, self._cycle = self._cycle, (0.0, 0.0, 0.0, 0.0)
        return cycle
