"""Per-request verify lengths (the default; --num-draft-tokens per-request): each drafting request gets its own k_i
in 0..K_max per step, from its running per-position acceptance, its remaining tokens and the step cost model.

Pure and exact: the acceptance counts are integers decayed by integer arithmetic, the costs integer microseconds
agreed across ranks (runtime/core/cost_model.py), and every comparison is between Fractions, so every rank that
sees the same requests picks the same k_i (never a float compared across ranks); ties are broken by position
(request order, then depth). The engine applies the choice (runtime/core/engine.py: depth d of the draft loop
runs the requests with k_i > d; the next verify carries k_i drafts of request i).

The rule: slot (i, j), request i's draft at depth j, is worth its expected emitted tokens,
P(d_0..d_j all accepted) = p_0 * .. * p_j (each p from the request's decayed counts; a new request starts from
the engine-wide running acceptance, not a fixed prior). It costs one verify row and one commit row, plus a draft
row at depth j, or a whole draft call when no request drafts that deep yet. For each number of draft depths D
the slots with j < D are admitted in order of gain while the step's expected tokens per predicted microsecond
improves; the D with the best rate wins (ties: fewer depths). A rank alone also learns the host's share of a
step and of a draft depth from its step records (`observe`), beyond the profiled graph calls. Gains fall with depth, so each request's slots
are a prefix 0..k_i-1. A request never drafts more than it may still emit: k_i <= remaining_i - 1 (the tail of
a closed batch does not verify a half-empty step). Every EXPLORE_EVERY choices one request drafts one depth deeper
than chosen (depth 0 when the step drafts nothing), so an acceptance that looked low is measured again.

Settled on nothing: after GIVE_UP_AFTER choices in a row that drafted nothing (exploration drafts do not count),
the engine knows drafting does not pay here, so a request admitted then starts without its MTP plane
(`keeps_mtp_plane`: no prompt commit, never drafts) except one admission in EXPLORER_EVERY (by the policy's own
admission count, an integer, so ranks that admit alike agree), which keeps it and is priced: if drafting pays
again (acceptance rose, or fewer requests share the steps) that explorer drafts, the engine is no longer
settled, and later admissions keep their planes again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from runtime.core.cost_model import CostModel
from runtime.core.step_record import StepRecord

# Integer exponential decay: each observation keeps 15/16 of the old counts (rounded down) and adds WEIGHT.
WEIGHT = 16
PRIOR_TRIALS, PRIOR_HITS = 2 * WEIGHT, WEIGHT  # the prior is worth two observations (of rate 1/2 engine-wide)
ONE = 1 << 32  # fixed point of gains: integer arithmetic, exact and identical on every rank, and fast
# Every EXPLORE_EVERY choices one request (in turn) drafts one depth deeper than chosen (a step that drafts nothing:
# one depth-0 row): else a depth's acceptance that once looked low would never be measured again.
EXPLORE_EVERY = 16
GIVE_UP_AFTER = 8  # ... and after this many choices in a row of nothing, the requests stop keeping their MTP plane
# Settled on nothing, one admitted request in this many still keeps its MTP plane (the rest pay K=0's cost): the
# explorers that re-discover a regime where drafting pays, at 1/8 of the MTP cost of keeping every plane
EXPLORER_EVERY = 8


@dataclass(slots=True)
class AcceptanceCounts:
    """One request's decayed per-depth counts: trials[j] = verifies that reached depth j, hits[j] = accepted."""

    trials: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    choices: int = 0  # steps the policy has chosen this request's k_i (its age in decisions)

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

    def _seen(self, depth: int) -> tuple[int, int]:
        return (self.hits[depth], self.trials[depth]) if depth < len(self.trials) else (0, 0)

    def rate(self, depth: int) -> Fraction:
        """Estimated P(draft at `depth` accepted | the ones before were) under the 1/2 prior, exact; never 0 or 1."""
        h, t = self._seen(depth)
        return Fraction(h + PRIOR_HITS, t + PRIOR_TRIALS)

    def fixed_rate(self, depth: int, prior: int) -> int:
        """The same estimate in fixed point (ONE = 1) with `prior` (fixed point) in place of 1/2."""
        h, t = self._seen(depth)
        return (h * ONE + prior * PRIOR_TRIALS) // (t + PRIOR_TRIALS)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request about to draft: its counts, how many tokens it may still emit after this step, and this step's
    verify as (drafts verified, accepted) when it verified drafts (the engine-wide acceptance learns from it)."""

    counts: AcceptanceCounts
    remaining: int
    verified: tuple[int, int] | None = None


class VerifyLengthPolicy(Protocol):
    def choose(self, candidates: list[Candidate], k_max: int) -> list[int]: ...


def cap(k: int, remaining: int, k_max: int) -> int:
    """k within 0..K_max and at most remaining - 1 (the verify emits k + 1 tokens at most)."""
    return max(0, min(k, k_max, remaining - 1))


@dataclass(slots=True)
class AcceptancePolicy:
    """The default per-request policy (module docstring). `pool` is the engine-wide running acceptance (every
    request's verifies): the prior of a request that has few verifies of its own."""

    cost: CostModel
    pool: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    _verify_us: list[int] = field(default_factory=list)  # main + commit microseconds by rows (a cache of cost)
    _draft_us: list[int] = field(default_factory=list)  # one draft call's microseconds by live rows
    _steps: int = 0  # choices made (the exploration's clock)
    _idle: int = 0  # choices in a row that could draft and drafted nothing (exploration drafts count as nothing)
    _admitted: int = 0  # requests admitted (`keeps_mtp_plane` calls): which ones explore once settled
    gives_up_drafting: bool = False  # this step's choice: stop keeping the MTP plane of requests at k = 0
    # Refined online from the step records (a rank alone: `observe`): the host's share of a step and of a draft
    # depth (planning, packing, Python), in microseconds beyond what the profile's graph calls predict
    step_extra_us: int = 0  # a step that keeps the MTP plane (commits)
    depth_extra_us: int = 0
    plain_extra_us: int | None = None  # a step without MTP work (its requests gave up drafting), once seen

    def observe(self, record: StepRecord) -> None:
        """Learn the host costs from a finished step's record (runtime/core/step_record.py; times on the engine's
        draft clock, the profile's). Integer running averages, each new step worth 1/8. A rank alone only: under
        mpirun each rank's clock differs, and the ranks must price alike (the engine does not call this there)."""
        if not record.num_scheduled or len(self._verify_us) <= record.main_rows:
            return
        draft_us = sum(self.cost.draft(max(r, 1)) for r in record.draft_rows)
        executor_us = self.cost.main(record.main_rows) + sum(self.cost.commit(r) for r in record.commit_rows)
        # Each sample is clipped at twice what the step's graph calls cost: a slower one is the process descheduled
        # or a first call's set-up, not host work, and one such spike (a 60 ms draft phase) once held the depth
        # cost at 8 ms, pricing drafting out for good: it decays only on steps that draft
        step = min(max(0, round((record.clock_seconds - record.clock_draft_seconds) * 1e6) - executor_us), 2 * executor_us)
        if record.commit_rows:
            self.step_extra_us += (step - self.step_extra_us) // 8
        else:
            plain = step if self.plain_extra_us is None else self.plain_extra_us
            self.plain_extra_us = plain + (step - plain) // 8
        if record.draft_rows:
            depth = (round(record.clock_draft_seconds * 1e6) - draft_us) // len(record.draft_rows)
            self.depth_extra_us += (min(max(0, depth), 2 * draft_us // len(record.draft_rows)) - self.depth_extra_us) // 8

    def choose(self, candidates: list[Candidate], k_max: int) -> list[int]:
        for c in candidates:
            if c.verified is not None:
                self.pool.observe(*c.verified)
        prior = [self.pool.fixed_rate(j, ONE // 2) for j in range(k_max)]
        offers: list[tuple[int, int, int]] = []  # (gain in fixed point, request position, depth)
        for i, c in enumerate(candidates):
            gain = ONE
            for j in range(cap(k_max, c.remaining, k_max)):
                gain = gain * c.counts.fixed_rate(j, prior[j]) // ONE
                offers.append((gain, i, j))
        offers.sort(key=lambda o: (-o[0], o[1], o[2]))  # ties: earlier request, then shallower depth
        base = max(1, len(candidates))  # every request verifies one row (its base token) and emits one token
        self._tables(base + len(offers), len(candidates))
        # drafting nothing is priced as giving up drafting (no commit, no MTP host work: what it becomes after
        # GIVE_UP_AFTER such choices), once such a step has been measured
        zero_us = self._verify_us[base] + self.step_extra_us
        if self.plain_extra_us is not None:
            zero_us = min(zero_us, self.cost.main(base) + self.plain_extra_us)
        best_ks, best_tokens, best_us = [0] * len(candidates), base * ONE, zero_us
        for depths in range(1, k_max + 1):
            ks, tokens, us = self._admit(offers, depths, base, len(candidates))
            if tokens * best_us > best_tokens * us:  # strictly better tokens per microsecond (exact integers)
                best_ks, best_tokens, best_us = ks, tokens, us
        self._steps += 1
        self._give_up(candidates, offers, best_ks)
        if offers and self._steps % EXPLORE_EVERY == 0:
            self._explore(candidates, offers, best_ks, k_max)
        return best_ks

    def _explore(self, candidates: list[Candidate], offers: list, ks: list[int], k_max: int) -> None:
        """One request (in turn) drafts one depth deeper than chosen: a depth that is never drafted is never
        measured, and its estimate would stay at the prior (at 1/2, or below after two misses, depth 1 of models/deep
        was priced out although it accepts ~80%). Drafting nothing, that is a depth-0 draft."""
        n = len(candidates)
        for i in sorted(range(n), key=lambda i: (i - self._steps) % n):
            if ks[i] < cap(k_max, candidates[i].remaining, k_max):
                ks[i] += 1
                self.gives_up_drafting = False  # the explorer drafts next: nobody freezes this step
                return

    @property
    def settled_on_nothing(self) -> bool:
        """GIVE_UP_AFTER choices in a row drafted nothing: the engine-wide verdict that drafting does not pay."""
        return self._idle >= GIVE_UP_AFTER

    def keeps_mtp_plane(self) -> bool:
        """Asked once per admitted request, in admission order, before its first forward: whether it keeps its
        MTP plane (commits its prompt, may draft). Settled on nothing, only every EXPLORER_EVERY-th does."""
        self._admitted += 1
        return not self.settled_on_nothing or self._admitted % EXPLORER_EVERY == 0

    def _give_up(self, candidates: list[Candidate], offers: list, ks: list[int]) -> None:
        """gives_up_drafting: GIVE_UP_AFTER choices in a row drafted nothing where drafting was possible, and every
        request that could draft has been priced that often (the explorers and the requests admitted before the
        engine settled; those admitted after start frozen: `keeps_mtp_plane`). The engine then lets this step's
        requests stop keeping their MTP plane (as `auto` does: docs/RUNTIME.md "Giving up drafting"): a request
        that keeps it at k = 0 pays a commit per token (~8% of a step on models/tiny with torch), which would make
        the default lose to K=0 where drafting never pays."""
        live = [c.counts for c in candidates if c.remaining > 0]
        for counts in live:
            counts.choices += 1
        if offers:
            self._idle = 0 if any(ks) else self._idle + 1
        self.gives_up_drafting = self.settled_on_nothing and all(c.choices >= GIVE_UP_AFTER for c in live)

    def _admit(self, offers: list[tuple[int, int, int]], depths: int, base: int, n: int) -> tuple[list[int], int, int]:
        """Slots of depth < `depths` by gain while the rate improves, each of the `depths` calls paid up front
        (an empty depth at one row's price). Returns k_i, expected tokens (fixed point) and the cost of the calls
        that actually run (the deepest k_i)."""
        ks, rows, verify, tokens = [0] * n, [0] * depths, base, base * ONE
        call = self.depth_extra_us  # a depth's host cost beyond its graph call
        us = self._verify_us[verify] + self.step_extra_us + depths * (self._draft_us[1] + call)
        for gain, i, j in offers:
            if j >= depths or j != ks[i]:
                continue
            more = (self._verify_us[verify + 1] - self._verify_us[verify]
                    + self._draft_us[max(rows[j] + 1, 1)] - self._draft_us[max(rows[j], 1)])  # fmt: skip
            if (tokens + gain) * us <= tokens * (us + more):
                break  # gains only fall from here: this rate is the best for `depths`
            ks[i], rows[j], verify, tokens, us = j + 1, rows[j] + 1, verify + 1, tokens + gain, us + more
        ran = [r for r in rows if r]
        return ks, tokens, self._verify_us[verify] + self.step_extra_us + sum(self._draft_us[r] + call for r in ran)

    def _tables(self, verify_rows: int, draft_rows: int) -> None:
        """Extend the cost caches to these row counts (a few list lookups per slot instead of interpolations)."""
        while len(self._verify_us) <= verify_rows:
            r = len(self._verify_us)
            self._verify_us.append(self.cost.main(r) + self.cost.commit(r))
        while len(self._draft_us) <= max(draft_rows, 1):
            self._draft_us.append(self.cost.draft(len(self._draft_us)))


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
