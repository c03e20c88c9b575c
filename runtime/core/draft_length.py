"""`--num-draft-tokens auto`: pick the draft length k in 0..K_max every step from measured costs and acceptance.

The engine is built for K_max drafts; drafting is a loop of depth calls, so any k <= K_max works per step.
Each step the controller predicts, for every k, the tokens the next verify emits per drafting request and
what that costs, and picks the k with the most tokens per second:

    tokens(k) = 1 + c_0 + c_0 c_1 + ... + c_0 .. c_{k-1}      c_j: acceptance at depth j given 0..j-1
    cost(k)   = b . [1, rows, k R] + o_k                         rows = base_rows + R k, R: requests drafting

cost(k) is the measured *cycle* of a draft length: the draft loop that made k drafts plus the whole next
step that verified them (verify, accept, commit, emit, host work). The shared part b is a ridge fit over
exponentially decayed sums of every cycle (recent steps weigh most): how cost grows with packed rows
(prefill) and with k x requests (batch size). o_k is k's own offset, a decayed mean of its residuals that
decays only when k is measured again, so the chosen k's many samples never decide what another k costs
and a k not tried for a while keeps its last estimate. Slow outliers are clipped. c_j are decayed success / trial counts. A k > 0 must beat
k = 0 by `zero_margin` (20%): the estimates carry errors of that size (on a shared 2-core machine a k = 1
estimated 1.13x of k = 0 at batch 8 measured 0.9-1.0x in the bench; costs that a cycle cannot see, such as
exploration), and the promise is that MTP is never slower than K=0.

Costs are kept per batch regime (drafting requests in power-of-two buckets: `regime`): drafting can pay at
batch 1, where a step's fixed cost dominates, and lose at batch 8, where rows dominate (the compiled engine
does both), and one fit across both would carry batch 1's choice into batch 8 until it re-learned. A regime
seen for the first time starts from its nearest neighbour's fit, measures k = 0 and explores soon; only a k
measured twice in the regime itself may be chosen there (the fit only says which k is worth measuring).
Acceptance is the model's, shared by all regimes.

Acceptance at depth j is only seen when k > j, so the controller explores: a warm-up that tries every k,
then the neighbours of the best k every `interval` steps; the interval doubles with every exploration
and halves when the best k changes. A neighbour already measured in this regime and predicted more than
`explore_gap` behind (after 3 measurements: one can be noise) is only re-checked every `max_interval` steps.

Where drafting never pays, `auto` must still be as fast as K=0 (its promise), so the k = 0 path is kept
cheap: the fit is plain floats (numpy's per-call overhead on a 3x3 system was ~50 us of a 1.5 ms step), and
while k = 0 is the settled choice only one step in `park_stride` builds a sample and decides
(`skips_this_step`). Once k = 1 has also been measured twice in the regime and lost, the engine lets that
step's requests stop keeping their MTP plane (`gives_up_drafting`, docs/RUNTIME.md "Giving up drafting"):
they then cost exactly what K=0 costs, and never draft again.

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
    """argparse `type=` for --num-draft-tokens: a non-negative int, "auto" or "per-request" (ArgumentTypeError:
    argparse prints the message as the one-line error)."""
    if text in (AUTO, "per-request"):
        return text
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give an int >= 0 (0 disables MTP), 'auto' or 'per-request'") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"{k}: must be >= 0 (0 disables MTP), 'auto' or 'per-request'")
    return k


ROW_SCALE, DRAFT_SCALE = 100.0, 10.0  # keep the features of similar size, so the ridge treats them alike


def features(k: int, num_drafting: float, rows: float) -> tuple[float, float, float]:
    return (1.0, rows / ROW_SCALE, k * num_drafting / DRAFT_SCALE)


@dataclass(slots=True)
class DecayedRidge:
    """y ~ b . x (3 features) by ridge least squares over exponentially decayed sums (recent observations weigh
    most). The ridge (relative to the total weight) keeps collinear features (a constant batch) solvable.

    Plain Python floats, not numpy: this runs every engine step, and for a 3x3 system numpy's per-call overhead
    (tens of microseconds) was a measurable share of a 1.5 ms compiled step."""

    decay: float = 0.98
    ridge: float = 1e-3
    xx: list[float] = field(default_factory=lambda: [0.0] * 9)  # row-major 3x3 sum of x x^T
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    weight: float = 0.0
    _coef: tuple[float, float, float] | None = None  # solved lazily, once per observation

    def observe(self, x: tuple[float, float, float], y: float) -> None:
        d, xx, xy = self.decay, self.xx, self.xy
        for i in range(3):
            xi = x[i]
            xy[i] = d * xy[i] + xi * y
            for j in range(3):
                xx[3 * i + j] = d * xx[3 * i + j] + xi * x[j]
        self.weight = d * self.weight + 1.0
        self._coef = None

    def coefficients(self) -> tuple[float, float, float]:
        if self._coef is None:
            lam = self.ridge * max(self.weight, 1e-12)
            a = list(self.xx)
            a[0] += lam
            a[4] += lam
            a[8] += lam
            self._coef = solve3(a, self.xy)
        return self._coef

    def predict(self, x: tuple[float, float, float]) -> float:
        if not self.weight:
            return 0.0
        c = self.coefficients()
        return c[0] * x[0] + c[1] * x[1] + c[2] * x[2]

    def copy(self) -> DecayedRidge:
        return DecayedRidge(self.decay, self.ridge, list(self.xx), list(self.xy), self.weight)


def solve3(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """x with A x = b for a symmetric positive definite row-major 3x3 A (Cramer's rule; the ridge keeps det > 0)."""
    a0, a1, a2, a3, a4, a5, a6, a7, a8 = a
    m0, m1, m2 = a4 * a8 - a5 * a7, a3 * a8 - a5 * a6, a3 * a7 - a4 * a6  # cofactors of the first row
    det = a0 * m0 - a1 * m1 + a2 * m2
    b0, b1, b2 = b
    x0 = (b0 * m0 - a1 * (b1 * a8 - a5 * b2) + a2 * (b1 * a7 - a4 * b2)) / det
    x1 = (a0 * (b1 * a8 - a5 * b2) - b0 * m1 + a2 * (a3 * b2 - b1 * a6)) / det
    x2 = (a0 * (a4 * b2 - b1 * a7) - a1 * (a3 * b2 - b1 * a6) + b0 * m2) / det
    return (x0, x1, x2)


@dataclass(slots=True)
class StepSample:
    """One step's measurements on one rank (or combined over ranks)."""

    cycle_seconds: float = 0.0  # a finished cycle: draft loop of step t-1 + all of step t but its draft loop
    cycle_depths: float = 0.0  # k of that draft loop
    cycle_drafting: float = 0.0  # requests that drafted in it
    cycle_rows: float = 0.0  # packed rows of step t's verify
    num_drafting: float = 0.0  # requests that draft now (the decision's R)
    base_rows: float = 0.0  # rows of this step without the drafts it verified (next verify's rows at k = 0)
    trials: list[float] = field(default_factory=list)  # per depth j: verifies that reached depth j
    successes: list[float] = field(default_factory=list)  # ... and accepted it
    # drafting requests by tokens they may still emit after this step: 1, 2, .., k_max, more (a request one
    # token from max_tokens gains nothing from drafts, so short outputs favour short drafts)
    remaining: list[float] = field(default_factory=list)

    def to_array(self, k_max: int) -> np.ndarray:
        head = [self.cycle_seconds, self.cycle_depths, self.cycle_drafting, self.cycle_rows, self.num_drafting,
                self.base_rows]  # fmt: skip
        pad = [0.0] * k_max
        counts = (list(self.trials) or pad) + (list(self.successes) or pad) + (list(self.remaining) or pad + [0.0])
        return np.array(head + counts, dtype=np.float64)

    @classmethod
    def from_array(cls, a: np.ndarray, k_max: int) -> StepSample:
        h = [float(x) for x in a[:6]]
        return cls(h[0], h[1], h[2], h[3], h[4], h[5], trials=a[6 : 6 + k_max].tolist(),
                   successes=a[6 + k_max : 6 + 2 * k_max].tolist(),
                   remaining=a[6 + 2 * k_max : 7 + 3 * k_max].tolist())  # fmt: skip


def combine(arrays: list[np.ndarray], k_max: int) -> StepSample:
    """Ranks step in lockstep, so a step lasts as long as its slowest rank: times and rows combine by max;
    acceptance counts add up. Every rank computes this from the same allgather, in the same order."""
    stacked = np.stack(arrays)
    out = stacked[:, :6].max(axis=0)
    counts = stacked[:, 6:].sum(axis=0)
    return StepSample.from_array(np.concatenate([out, counts]), k_max)


def regime(num_drafting: float) -> int:
    """The batch regime of a decision: drafting requests in power-of-two buckets (1, 2-3, 4-7, 8-15, ...).
    What a draft depth costs relative to a verify row depends on the batch (batch 1 is bound by fixed cost,
    batch 8 by rows), so each regime keeps its own cost fit and exploration state."""
    return int(num_drafting).bit_length()


def decode_like(base_rows: float, num_drafting: float) -> bool:
    """A step's rows without drafts are (about) one per drafting request, not a prefill chunk beside them."""
    return base_rows <= 2 * num_drafting


@dataclass(slots=True)
class RegimeCosts:
    """One regime's cost fit, per-k offsets and exploration state (see the module docstring)."""

    k_max: int
    decay: float
    min_interval: int
    cost: DecayedRidge = field(default_factory=DecayedRidge)
    offset_sum: list[float] = field(default_factory=list)  # per k: decayed residuals of the shared fit
    offset_weight: list[float] = field(default_factory=list)
    best: int = 0
    interval: int = 8
    since_explore: int = 0
    explore_step: int = 0  # alternates up / down neighbours
    warmup: list[int] = field(default_factory=list)  # draft lengths still to try before deciding
    seen: list[int] = field(default_factory=list)  # per k: cycles measured in this regime (not seeded)

    def __post_init__(self) -> None:
        self.cost = DecayedRidge(decay=self.decay)
        self.offset_sum, self.offset_weight = [0.0] * (self.k_max + 1), [0.0] * (self.k_max + 1)
        self.seen = [0] * (self.k_max + 1)
        self.interval = self.min_interval
        self.warmup = [self.k_max - i // 2 for i in range(2 * (self.k_max + 1))]  # k_max, k_max, ..., 0, 0

    def seeded_from(self, other: RegimeCosts) -> RegimeCosts:
        """A new regime starts from a neighbour's fit (the shared cost structure carries over); its per-k
        offsets are its own, learnt as it measures each k."""
        self.cost = other.cost.copy()  # per-k offsets are the regime's own: they start empty
        self.warmup = [0]  # (a full warm-up per regime made batch 8 draft where it loses: 0.86x of K=0, compiled)
        self.interval = max(1, self.min_interval // 4)  # learn soon: a batch-8 bench run is ~65 steps
        return self

    def offset(self, k: int) -> float:
        return self.offset_sum[k] / self.offset_weight[k] if self.offset_weight[k] else 0.0


@dataclass(slots=True)
class DraftLengthController:
    k_max: int
    zero_margin: float = 0.20  # a k > 0 must promise this much more throughput than k = 0
    margin: float = 0.02  # a new best k must promise this much more than the current one
    decay: float = 0.98  # per step, for the cost fit (half-life ~35 steps)
    acceptance_decay: float = 0.98  # per measured step, for the acceptance counts (half-life ~35)
    min_interval: int = 16  # steps between explorations, doubling up to max_interval while nothing changes
    max_interval: int = 256
    prior_trials: float = 2.0  # acceptance prior: c_j = 0.5 with the weight of 2 observations
    outlier: float = 1.5  # a cycle slower than this times its prediction counts as this (noise is one-sided)
    offset_decay: float = 0.9  # per measurement of that k
    explore_gap: float = 0.3  # a neighbour measured in this regime and predicted this far behind is explored
    # only every max_interval steps (on a model where drafting never pays, exploring is pure loss)
    park_stride: int = 4  # while k = 0 is the settled choice, one step in this many is measured and decided
    regimes: dict[int, RegimeCosts] = field(default_factory=dict)  # cost state per batch regime
    succ: list[float] = field(default_factory=list)  # acceptance is the model's, shared by every regime
    trials: list[float] = field(default_factory=list)
    parked: int = 0  # steps left that run k = 0 without a sample (see skips_this_step)
    last_k: int = 0  # the previous decision (its cycle is only measured two steps later)
    settled_zero: bool = False  # the last decision was k = 0 by choice, twice in a row (not warm-up, not exploring)
    gives_up_drafting: bool = False  # ... and k = 1 was measured twice in this regime and lost (see choose)

    def __post_init__(self) -> None:
        self.succ, self.trials = [0.0] * self.k_max, [0.0] * self.k_max

    def forget(self) -> None:
        """Drop what was learnt (acceptance, costs, exploration), keep the settings: the bench's warm-up run
        pays one-off costs (first calls of every compiled graph) that are not what a draft length costs."""
        self.regimes = {}
        self.succ, self.trials = [0.0] * self.k_max, [0.0] * self.k_max
        self.parked, self.last_k, self.settled_zero, self.gives_up_drafting = 0, 0, False, False

    def skips_this_step(self) -> bool:
        """True: run k = 0 and build no sample. While k = 0 is the settled choice only one step in `park_stride`
        is measured and decided: a k = 0 step teaches acceptance nothing and its cost is well known, and the
        per-step host work (sample, fit, decision) was a measurable share of a ~1.5 ms compiled step, where
        `auto` must not lose to K=0. Depends on the controller's state only, so every rank skips alike."""
        if self.parked:
            self.parked -= 1
            return True
        return False

    def regime_costs(self, num_drafting: float) -> RegimeCosts:
        """The regime's state, created on first use (seeded from the nearest regime seen, if any)."""
        key = regime(num_drafting)
        if key not in self.regimes:
            fresh = RegimeCosts(self.k_max, self.decay, self.min_interval)
            near = min(self.regimes, key=lambda r: (abs(r - key), r), default=None)
            self.regimes[key] = fresh if near is None else fresh.seeded_from(self.regimes[near])
        return self.regimes[key]

    # ------------------------------------------------------------------ learning
    def observe(self, s: StepSample) -> None:
        # a decision's cycle, and a decode-like one: a prefill chunk in the verify step adds tens to hundreds of
        # rows whose cost is not linear in them (MoE expert coverage saturates), and a fit that takes them in
        # extrapolated decode costs that were off by 4x, even negative; the same cost at every k, it hardly
        # moves the decision anyway
        decode = decode_like(s.cycle_rows - s.cycle_drafting * s.cycle_depths, s.cycle_drafting)
        if s.cycle_seconds > 0 and s.cycle_drafting > 0 and decode:
            rc = self.regime_costs(s.cycle_drafting)
            k = int(s.cycle_depths)
            x = features(k, s.cycle_drafting, s.cycle_rows)
            shared = rc.cost.predict(x)
            offset = rc.offset(k)
            y = s.cycle_seconds
            if rc.cost.weight > 10:  # warmed up: clip outliers (a preempted process, a GC pause)
                y = min(y, self.outlier * max(shared + offset, 1e-6))
            rc.cost.observe(x, y - offset)  # the shared fit sees every k with its offset taken out
            rc.offset_sum[k] = self.offset_decay * rc.offset_sum[k] + (y - shared)  # k's own offset learns
            rc.offset_weight[k] = self.offset_decay * rc.offset_weight[k] + 1.0
            rc.seen[k] += 1
        d = self.acceptance_decay
        for j in range(self.k_max):
            t = s.trials[j] if j < len(s.trials) else 0.0
            if t:  # decay only what was measured again, so rarely explored depths keep their last estimate
                self.trials[j] = d * self.trials[j] + t
                self.succ[j] = d * self.succ[j] + s.successes[j]

    def acceptance(self) -> list[float]:
        """c_j: conditional acceptance per depth (prior 0.5)."""
        p = self.prior_trials
        return [(self.succ[j] + p / 2) / (self.trials[j] + p) for j in range(self.k_max)]

    def expected_tokens_table(self, acceptance: list[float] | None = None) -> list[float]:
        """E[accepted + 1] per drafting request for k = 0..k_max: 1, 1 + c_0, 1 + c_0 + c_0 c_1, ..."""
        table, run = [1.0], 1.0
        for c in acceptance or self.acceptance():
            run *= c
            table.append(table[-1] + run)
        return table

    def predicted_costs(self, num_drafting: float, base_rows: float) -> list[float]:
        """Seconds of the cycle for k = 0..k_max: k draft depths now, then the step that verifies them.
        (The features dotted with the coefficients, in plain floats: this runs every step.)"""
        rc = self.regime_costs(num_drafting)
        if not rc.cost.weight:
            return [0.0] * (self.k_max + 1)
        c = rc.cost.coefficients()
        return [c[0] + c[1] * (base_rows + num_drafting * k) / ROW_SCALE + c[2] * k * num_drafting / DRAFT_SCALE
                + rc.offset(k) for k in range(self.k_max + 1)]  # fmt: skip

    def rates(self, num_drafting: float, base_rows: float, remaining: list[float] | None = None) -> list[float]:
        """Predicted tokens per second of the drafting requests for k = 0..k_max (rows of other requests
        add the same tokens at every k). remaining: StepSample.remaining (None: nobody is near its end)."""
        costs, table = self.predicted_costs(num_drafting, base_rows), self.expected_tokens_table()
        out = []
        for k, c in enumerate(costs):
            if remaining:  # a request that may emit m more tokens uses at most m - 1 drafts
                tokens = sum(n * table[min(k, m)] for m, n in enumerate(remaining) if n)
            else:
                tokens = num_drafting * table[k]
            out.append(tokens / c if c > 0 else 0.0)
        return out

    def best_k(self, num_drafting: float, base_rows: float, remaining: list[float] | None = None) -> int:
        """The best k; k > 0 must beat k = 0 by `zero_margin`, and a new best the current one by `margin` (no
        flapping between two lengths that the noise cannot tell apart)."""
        return self._best(self.rates(num_drafting, base_rows, remaining), self.regime_costs(num_drafting).best)

    def _best(self, r: list[float], current: int) -> int:
        score = [r[0]] + [x / (1 + self.zero_margin) for x in r[1:]]
        best = max(range(self.k_max + 1), key=lambda k: score[k])
        if best != current and score[best] <= score[current] * (1 + self.margin):
            return current
        return best

    # ------------------------------------------------------------------ deciding
    def choose(self, num_drafting: float, base_rows: float, remaining: list[float] | None = None) -> int:
        """The draft length of this step (0 when nobody drafts: nothing to learn, nothing to run).

        After it, `gives_up_drafting` says whether the engine may let this step's requests stop keeping their MTP
        plane (runtime/core/engine.py): k = 0 is settled and k = 1, measured twice in this regime, lost to it. A
        request that keeps its MTP plane at k = 0 pays a commit of one MTP layer per token and the carry's host
        work (3-6% of a step on models/tiny), which would make `auto` lose to K=0 exactly where drafting never
        pays. Requiring k = 1's own measurements first keeps a fresh regime (say the last requests of a batch)
        able to find out that drafting pays there. (Longer k are not required: a seeded regime measures them only
        when its fit says they pay, see seeded_from.)"""
        self.settled_zero = self.gives_up_drafting = False
        self.last_k = self._choose(num_drafting, base_rows, remaining)
        if self.settled_zero and num_drafting > 0:
            self.gives_up_drafting = self.regime_costs(num_drafting).seen[1] >= 2
        return self.last_k

    def _choose(self, num_drafting: float, base_rows: float, remaining: list[float] | None) -> int:
        if self.k_max == 0 or num_drafting <= 0:
            return 0
        rc = self.regime_costs(num_drafting)
        if rc.warmup:
            return rc.warmup.pop(0)
        r = self.rates(num_drafting, base_rows, remaining)
        # only a k measured twice in this regime may be chosen (k = 0 always may: K=0 is the promise; one
        # sample can be noise); the fit's prediction for an unmeasured k only decides whether to explore it
        best = self._best([x if k == 0 or rc.seen[k] >= 2 else 0.0 for k, x in enumerate(r)], rc.best)
        if best != rc.best:  # explore sooner after a change, but not from scratch: noise flips it too
            rc.best, rc.interval = best, max(self.min_interval, rc.interval // 2)
        # park only after two k = 0 decisions: a k > 0 cycle is reported two steps after its decision
        self.settled_zero = best == 0 and self.last_k == 0
        self.parked = self.park_stride - 1 if self.settled_zero else 0
        rc.since_explore += 1 + self.parked  # intervals count steps, parked ones too
        if rc.since_explore < rc.interval or not decode_like(base_rows, num_drafting):
            return best  # (a step with prefill rows is not learnt from: explore at the next decode step)
        self.parked, self.settled_zero = 0, False
        rc.since_explore = 0
        rc.interval = min(2 * rc.interval, self.max_interval)
        rc.explore_step += 1
        promising = max(range(self.k_max + 1), key=lambda k: r[k])
        if rc.seen[promising] < 2 and r[promising] > (1 + self.zero_margin) * r[best]:
            return promising  # the fit says an unmeasured k beats the best: measure it
        up, down = min(best + 1, self.k_max), max(best - 1, 0)
        k = up if (rc.explore_step % 2 or down == best) and up != best else down
        if rc.seen[k] >= 3 and r[k] < (1 - self.explore_gap) * r[best] and rc.interval < self.max_interval:
            rc.interval = self.max_interval  # measured here and far behind: only the rare check at max_interval
            return best
        return k
