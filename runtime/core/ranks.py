"""How the engine takes part in a job: the rank strategy it is constructed with.

The engine calls these hooks and nothing else about ranks; it never imports MPI. `RankStrategy` itself is a
rank alone (every hook a no-op). The multi-rank strategies (DP lockstep, TP leader, TP follower) live in
runtime/multirank/strategies.py and are chosen once, by runtime/multirank/strategies.py `rank_strategy`,
before the engine exists (docs/ARCHITECTURE.md §8).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from runtime.executors.base import Executor


class RankStrategy:
    """A single rank: no lockstep, nothing to broadcast, nobody to agree with."""

    # Invariant 9: in a lockstep job an idle rank still runs one dummy main forward and k dummy draft depths
    # per step, because the MoE exchange inside them is a collective every rank must enter.
    lockstep: bool = False
    is_follower: bool = False  # a TP follower replays its leader's executor calls and never steps an engine
    dp_rank: int = 0  # which data-parallel group (= which share of the requests) this rank serves
    dp_size: int = 1

    def executor(self, executor: Executor) -> Executor:
        """The executor the engine steps (a TP leader's broadcasts each call to its followers first)."""
        return executor

    def begin_step(self) -> None:
        """Called before each step (the watchdog numbers steps)."""

    def end_step(self) -> None:
        """Called after each step, also a failed one (a TP leader tells its followers the step ended)."""

    def any_busy(self, busy: bool) -> bool:
        """Whether any DP group still has work (the engine steps until none has): the lockstep busy check."""
        return busy

    def gather_draft_samples(self, sample: np.ndarray) -> list[np.ndarray]:
        """Every DP group's draft-length sample, so `auto` picks the same k on every rank."""
        return [sample]

    def gather_to_first(self, value: Any) -> list[Any] | None:
        """DP leaders: every group's value on group 0 (None elsewhere); the results of a multi-group run."""
        return [value]

    def stop(self) -> None:
        """The leader is done: release the followers (idempotent)."""

    def on_collective_timeout(self, fn: Callable[[str], None]) -> None:
        """Call fn(the collective watchdog's line) before this rank leaves through it (a rank alone has none)."""


SINGLE_RANK = RankStrategy()
