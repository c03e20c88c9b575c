"""The one metrics source of the serving frontends: a snapshot the engine loop takes after each iteration.

Frontends export it (Triton's custom metrics, the OpenAI frontend's Prometheus collector) and never read the
engine themselves, so a scrape never races the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.core.step_record import StepRecord

OUTCOMES = ("admitted", "finished", "cancelled", "failed", "rejected")


@dataclass
class Counts:
    """Request outcomes since the loop started: admitted == finished + cancelled + failed once idle; rejected
    requests never reached the engine."""

    by_outcome: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    def add(self, outcome: str) -> None:
        self.by_outcome[outcome] += 1


@dataclass(slots=True)
class LoopStats:
    running: int = 0  # scheduled in the engine
    waiting: int = 0  # queued in the engine or the loop, not yet scheduled
    active: int = 0  # admitted requests the loop still streams to
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0  # engine side: also counts tokens of requests nobody reads any more
    num_verify_steps: int = 0
    num_preemptions: int = 0
    mean_acceptance_length: float = 0.0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_collapse_warnings: int = 0  # the engine's running collapse detector (runtime/core/acceptance_guard.py)
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    last_step: StepRecord | None = None  # the engine's record of its last step (never changed once published)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position,
                                                    strict=True)]  # fmt: skip


def take(engine: Any, num_pending: int, num_active: int, counts: Counts) -> LoopStats:
    """Snapshot the engine's state (called on the engine-loop thread only)."""
    m, sched, kv = engine.metrics, engine.scheduler, engine.kv
    return LoopStats(len(sched.running), len(sched.waiting) + num_pending, num_active, kv.num_used_blocks,
                     kv.num_free_blocks, kv.stats.num_hit_tokens, m.num_generated_tokens, m.num_verify_steps,
                     m.num_preemptions, m.mean_acceptance_length, list(m.proposed_per_position),
                     list(m.accepted_per_position), engine.acceptance_watch.num_warnings,
                     dict(counts.by_outcome), engine.last_step)  # fmt: skip
