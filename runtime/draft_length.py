"""`--num-draft-tokens auto`: pick the draft length k in 0..K_max every step from measured costs and acceptance.

The engine is built for K_max drafts; drafting is a loop of depth calls, so any k <= K_max works per step.
Each step the controller predicts, for every k, the tokens the next verify emits per drafting request and
what the step costs, and picks the k with the most tokens per second:

    tokens(k) = 1 + c_0 + c_0 c_1 + ... + c_0 .. c_{k-1}          c_j: acceptance at depth j given 0..j-1
    cost(k)   = host + main(base_rows + R k) + k draft(R)         R: requests that draft this step

`main` (seconds vs packed rows) and `draft` (seconds per depth vs rows) are least-squares lines over
exponentially decayed sums, `host` is the decayed mean of everything else in a step, c_j are decayed
success / trial counts. A k > 0 must beat k = 0 by `margin`, so noise never makes MTP slower than K=0.

Acceptance at depth j is only seen when k > j, so the controller explores: a warm-up that tries every k,
then the neighbours of the best k every `interval` steps; the interval doubles while exploring does not
change the choice (its cost vanishes on a model where drafting never pays) and resets when it does.

Lockstep: the controller is deterministic (no random numbers). Under MPI every rank feeds it the same
combined measurements (`combine` over an allgather of each rank's `StepSample.to_array()`), so every rank
picks the same k and issues the same number of draft forwards.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

AUTO = "auto"


def parse_num_draft_tokens(text: str) -> int | str:
    """argparse `type=` for --num-draft-tokens: a non-negative int or "auto" (ArgumentTypeError: argparse
    prints the message as the one-line error)."""
    if text == AUTO:
        return AUTO
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give an int >= 0 (0 disables MTP) or 'auto'") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"{k}: must be >= 0 (0 disables MTP) or 'auto'")
    return k


@dataclass(slots=True)
class DecayedLine:
    """y ~ a + b x by least squares over exponentially decayed sums (recent steps weigh most)."""

    decay: float = 0.95
    sw: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sxx = d * self.sw + 1, d * self.sx + x, d * self.sxx + x * x
        self.sy, self.sxy = d * self.sy + y, d * self.sxy + x * y

    @property
    def ready(self) -> bool:
        return self.sw > 0

    def predict(self, x: float) -> float:
        if not self.sw:
            return 0.0
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        # no spread in x yet: a flat line (the warm-up and exploration provide the spread)
        b = (self.sxy / self.sw - mx * my) / var if var > 1e-9 * max(1.0, mx * mx) else 0.0
        b = max(b, 0.0)  # more rows never cost less; guards the fit against timing noise
        return max(my + b * (x - mx), 0.0)


@dataclass(slots=True)
class StepSample:
    """One step's measurements on one rank (or combined over ranks)."""

    main_seconds: float = 0.0  # the verify forward
    main_rows: float = 0.0  # its packed rows
    draft_seconds: float = 0.0  # the whole draft loop (forwards + per-depth host work), 0 without drafts
    draft_rows: float = 0.0  # requests that drafted
    draft_depths: float = 0.0  # depths the loop ran
    host_seconds: float = 0.0  # the rest of the previous step (schedule, accept, commit, emit, publish)
    num_drafting: float = 0.0  # requests that draft now (the decision's R)
    base_rows: float = 0.0  # rows of this step without the drafts it verified (next step's rows at k = 0)
    trials: list[float] = field(default_factory=list)  # per depth j: verifies that reached depth j
    successes: list[float] = field(default_factory=list)  # ... and accepted it

    def to_array(self, k_max: int) -> np.ndarray:
        head = [self.main_seconds, self.main_rows, self.draft_seconds, self.draft_rows, self.draft_depths,
                self.host_seconds, self.num_drafting, self.base_rows]  # fmt: skip
        pad = [0.0] * k_max
        return np.array(head + (list(self.trials) or pad) + (list(self.successes) or pad), dtype=np.float64)

    @classmethod
    def from_array(cls, a: np.ndarray, k_max: int) -> StepSample:
        h = [float(x) for x in a[:8]]
        return cls(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], trials=a[8 : 8 + k_max].tolist(),
                   successes=a[8 + k_max : 8 + 2 * k_max].tolist())  # fmt: skip


def combine(arrays: list[np.ndarray], k_max: int) -> StepSample:
    """Ranks step in lockstep, so a step lasts as long as its slowest rank: times and rows combine by max;
    acceptance counts add up. Every rank computes this from the same allgather, in the same order."""
    stacked = np.stack(arrays)
    out = stacked[:, :8].max(axis=0)
    counts = stacked[:, 8:].sum(axis=0)
    return StepSample.from_array(np.concatenate([out, counts]), k_max)


@dataclass(slots=True)
class DraftLengthController:
    k_max: int
    margin: float = 0.02  # a k > 0 must promise this much more throughput than k = 0
    decay: float = 0.95  # per step, for costs and acceptance counts (half-life ~14 steps)
    min_interval: int = 8  # steps between explorations, doubling up to max_interval while nothing changes
    max_interval: int = 256
    prior_trials: float = 2.0  # acceptance prior: c_j = 0.5 with the weight of 2 observations
    main: DecayedLine = field(default_factory=DecayedLine)
    draft: DecayedLine = field(default_factory=DecayedLine)  # seconds per depth vs drafting rows
    host: float = 0.0
    host_weight: float = 0.0
    succ: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    best: int = 0
    interval: int = 8
    since_explore: int = 0
    explore_step: int = 0  # alternates up / down neighbours
    num_decisions: int = 0

    def __post_init__(self) -> None:
        self.succ, self.trials = [0.0] * self.k_max, [0.0] * self.k_max
        self.main, self.draft = DecayedLine(self.decay), DecayedLine(self.decay)
        self.interval = self.min_interval

    # ------------------------------------------------------------------ learning
    def observe(self, s: StepSample) -> None:
        if s.main_rows > 0:
            self.main.observe(s.main_rows, s.main_seconds)
        if s.draft_depths > 0 and s.draft_rows > 0:
            self.draft.observe(s.draft_rows, s.draft_seconds / s.draft_depths)
        if s.host_seconds > 0:
            self.host = self.decay * self.host + s.host_seconds
            self.host_weight = self.decay * self.host_weight + 1
        for j in range(self.k_max):
            t = s.trials[j] if j < len(s.trials) else 0.0
            if t:  # decay only what was measured again, so rarely explored depths keep their last estimate
                self.trials[j] = self.decay * self.trials[j] + t
                self.succ[j] = self.decay * self.succ[j] + s.successes[j]

    def acceptance(self) -> list[float]:
        """c_j: conditional acceptance per depth (prior 0.5)."""
        p = self.prior_trials
        return [(self.succ[j] + p / 2) / (self.trials[j] + p) for j in range(self.k_max)]

    def expected_tokens(self, k: int) -> float:
        """E[accepted + 1] per drafting request at draft length k."""
        total, run = 1.0, 1.0
        for c in self.acceptance()[:k]:
            run *= c
            total += run
        return total

    def cost(self, k: int, num_drafting: float, base_rows: float) -> float:
        host = self.host / self.host_weight if self.host_weight else 0.0
        return host + self.main.predict(base_rows + num_drafting * k) + k * self.draft.predict(num_drafting)

    def rates(self, num_drafting: float, base_rows: float) -> list[float]:
        """Predicted tokens per second for k = 0..k_max (draft-independent rows of other requests ignored:
        they add the same tokens at every k)."""
        out = []
        for k in range(self.k_max + 1):
            c = self.cost(k, num_drafting, base_rows)
            out.append(self.expected_tokens(k) / c if c > 0 else 0.0)
        return out

    def best_k(self, num_drafting: float, base_rows: float) -> int:
        if not (self.main.ready and self.draft.ready):
            return self.k_max  # nothing to compare yet
        r = self.rates(num_drafting, base_rows)
        best = max(range(1, self.k_max + 1), key=lambda k: r[k], default=0)
        return best if r[best] > r[0] * (1 + self.margin) else 0

    # ------------------------------------------------------------------ deciding
    def choose(self, num_drafting: float, base_rows: float) -> int:
        """The draft length of this step (0 when nobody drafts: nothing to learn, nothing to run)."""
        if self.k_max == 0 or num_drafting <= 0:
            return 0
        n = self.num_decisions
        self.num_decisions += 1
        warmup = [self.k_max - i // 2 for i in range(2 * (self.k_max + 1))]  # k_max, k_max, ..., 0, 0
        if n < len(warmup):
            return warmup[n]
        best = self.best_k(num_drafting, base_rows)
        if best != self.best:
            self.best, self.interval, self.since_explore = best, self.min_interval, 0
        self.since_explore += 1
        if self.since_explore < self.interval:
            return best
        self.since_explore = 0
        self.interval = min(2 * self.interval, self.max_interval)
        self.explore_step += 1
        up, down = min(best + 1, self.k_max), max(best - 1, 0)
        return up if (self.explore_step % 2 or down == best) and up != best else down
