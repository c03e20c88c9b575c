"""Per-request verify lengths (--num-draft-tokens per-request): each drafting request gets its own k_i in
0..K_max per step, from its own running per-position acceptance, its remaining tokens and a step budget.

Pure and exact: the acceptance counts are integers decayed by integer arithmetic, and gains are compared as
Fractions, so every rank that sees the same requests picks the same k_i (never a float compared across ranks);
ties are broken by position (request order, then depth). The engine applies the choice (runtime/core/engine.py:
depth d of the draft loop runs the requests with k_i > d; the next verify carries k_i drafts of request i).

The rule: depth j of request i is worth its expected emitted tokens, P(d_0..d_j all accepted) = p_0 * .. * p_j
(each p from the decayed counts with a prior), and costs one draft row plus one verify row. A depth is drafted
when that gain reaches `min_gain` (the cost model's price of a row, in tokens) and it is among the `max_rows`
best gains of the step; gains fall with depth, so each request's chosen depths are a prefix 0..k_i-1. A request
never drafts more than it may still emit: k_i <= remaining_i - 1 (closed batches do not verify a half-empty tail).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

# Integer exponential decay: each observation keeps 15/16 of the old counts (rounded down) and adds WEIGHT.
WEIGHT = 16
PRIOR_TRIALS, PRIOR_HITS = 2 * WEIGHT, WEIGHT  # a new request starts at p = 1/2 per depth, worth two observations


@dataclass(slots=True)
class AcceptanceCounts:
    """One request's decayed per-depth counts: trials[j] = verifies that reached depth j, hits[j] = accepted."""

    trials: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, accepted: int) -> None:
        """A verify of num_drafts drafts of which the first `accepted` matched: depth j was reached when
        j <= accepted and accepted when j < accepted."""
        grow = num_drafts - len(self.trials)
        if grow > 0:
            self.trials += [0] * grow
            self.hits += [0] * grow
        for j in range(min(num_drafts, accepted + 1)):
            self.trials[j] += WEIGHT - self.trials[j] // 16
            self.hits[j] += (WEIGHT if j < accepted else 0) - self.hits[j] // 16

    def rate(self, depth: int) -> Fraction:
        """Estimated P(draft at `depth` accepted | the ones before were), exact; never 0 or 1 (the prior)."""
        t = self.trials[depth] if depth < len(self.trials) else 0
        h = self.hits[depth] if depth < len(self.hits) else 0
        return Fraction(h + PRIOR_HITS, t + PRIOR_TRIALS)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request about to draft: its counts and how many tokens it may still emit after this step."""

    counts: AcceptanceCounts
    remaining: int


@dataclass(frozen=True, slots=True)
class RowCost:
    """The step cost model: a draft row (one draft forward row + one verify row) is worth drafting when its
    expected emitted tokens reach min_gain; at most max_rows draft rows per step (None: no step limit)."""

    min_gain: Fraction = Fraction(1, 3)
    max_rows: int | None = None


class VerifyLengthPolicy(Protocol):
    def choose(self, candidates: list[Candidate], k_max: int) -> list[int]: ...


def cap(k: int, remaining: int, k_max: int) -> int:
    """k within 0..K_max and at most remaining - 1 (the verify emits k + 1 tokens at most)."""
    return max(0, min(k, k_max, remaining - 1))


@dataclass(frozen=True, slots=True)
class AcceptancePolicy:
    """The default per-request policy (module docstring)."""

    cost: RowCost = RowCost()

    def choose(self, candidates: list[Candidate], k_max: int) -> list[int]:
        offers: list[tuple[Fraction, int, int]] = []  # (gain, request position, depth)
        for i, c in enumerate(candidates):
            gain = Fraction(1)
            for j in range(cap(k_max, c.remaining, k_max)):
                gain *= c.counts.rate(j)
                if gain < self.cost.min_gain:
                    break
                offers.append((gain, i, j))
        offers.sort(key=lambda o: (-o[0], o[1], o[2]))  # ties: earlier request, then shallower depth
        if self.cost.max_rows is not None:
            offers = offers[: self.cost.max_rows]
        ks = [0] * len(candidates)
        for _, i, j in sorted(offers, key=lambda o: (o[1], o[2])):
            if j == ks[i]:  # depths are taken as a prefix (a gap would make later depths unreachable)
                ks[i] = j + 1
        return ks


@dataclass(frozen=True, slots=True)
class FixedPattern:
    """Forced ragged lengths: request at position i drafts pattern[(i + step) % len] (capped). A real policy,
    used by the lossless tests to exercise every shape of ragged draft loop and verify."""

    pattern: tuple[int, ...]
    chosen: list[list[int]] = field(default_factory=list)  # every step's k_i, in order (the tests read it)

    def choose(self, candidates: list[Candidate], k_max: int) -> list[int]:
        s, n = len(self.chosen), len(self.pattern)
        self.chosen.append([cap(self.pattern[(i + s) % n], c.remaining, k_max) for i, c in enumerate(candidates)])
        return self.chosen[-1]
