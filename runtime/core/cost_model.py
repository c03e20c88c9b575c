"""The step cost model of per-request verify lengths: microseconds of each graph call as a function of its rows,
measured on this machine when the engine is created (runtime/core/verify_lengths.py prices a draft slot with it).

Measured, never assumed: how a verify row compares with a draft row depends on the executor, the model, the
thread count and the kernels (multi-row verify kernels keep getting cheaper), so the engine times its own graphs.
`profile` runs each graph at a few row counts on the null block (live rows whose KV writes land in the reserved
block 0, like an idle rank's padding) and keeps the fastest of a few timings in integer microseconds. The rows are
tokens and hiddens drawn from a fixed seed, unlike each other as a real batch's rows are: identical rows take one route
through a MoE layer's experts, so a verify of 8-32 such rows read each selected expert once and looked nearly as cheap
as one row, while a real batch's rows spread over many experts; priced that way, drafting at 8-32 requests looked
cheap and lost to K=0 (0.7-0.9x in serving). Under mpirun
`agree` takes every rank's figures and keeps the elementwise maximum: integers, so every rank prices every step
identically and chooses the same k_i (never a float compared across ranks). Between sampled row counts the cost
is interpolated linearly in integer arithmetic, and made non-decreasing (timing noise must not make a row free).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np

from runtime.core.block_pool import NULL_BLOCK_ID
from runtime.executors.base import CommitInput, DraftInput, MainInput

# Timings per point, after one warm-up call; the fastest counts: on shared cores the other jobs only ever add
# time, and one slow sample at one row count would otherwise price a whole depth out for the engine's life
REPEATS = 5


@dataclass(frozen=True, slots=True)
class CostCurve:
    """Microseconds of one graph call at `rows[i]` rows (rows ascending, costs non-decreasing integers)."""

    rows: tuple[int, ...]
    micros: tuple[int, ...]

    def __call__(self, n: int) -> int:
        """Cost of a call of n rows (0: no call); linear between samples, the last slope past the end."""
        if n <= 0:
            return 0
        rows, us = self.rows, self.micros
        if len(rows) == 1:
            return us[0] * n // rows[0] if n > rows[0] else us[0]
        b = min(max(bisect_left(rows, n), 1), len(rows) - 1)
        a = b - 1
        return max(us[0], us[a] + (us[b] - us[a]) * (n - rows[a]) // (rows[b] - rows[a]))


@dataclass(frozen=True, slots=True)
class CostModel:
    """One step's predicted microseconds: the verify, the commit and each draft depth's call."""

    main: CostCurve
    draft: CostCurve
    commit: CostCurve

    def step(self, verify_rows: int, depth_rows: list[int]) -> int:
        """A step whose verify packs verify_rows rows and whose draft loop runs one call per entry of depth_rows
        (its live rows). The commit writes about as many rows as the verify checked (verified drafts + base)."""
        return self.main(verify_rows) + self.commit(verify_rows) + sum(self.draft(max(r, 1)) for r in depth_rows)

    def to_array(self) -> np.ndarray:
        return np.array(self.main.micros + self.draft.micros + self.commit.micros, np.int64)

    def with_micros(self, flat: list[int]) -> CostModel:
        """The same sample rows with other figures (the agreed ones), in to_array's order."""
        curves, at = [], 0
        for c in (self.main, self.draft, self.commit):
            curves.append(CostCurve(c.rows, monotone(flat[at : at + len(c.rows)])))
            at += len(c.rows)
        return CostModel(*curves)


def monotone(us: list[int]) -> tuple[int, ...]:
    out, top = [], 1
    for u in us:
        top = max(top, int(u))
        out.append(top)
    return tuple(out)


def main_rows(max_rows: int) -> list[int]:
    """Verify sample rows: every count to 8 (where batch-1 and small-batch verifies live), then about x1.5 steps."""
    rows, r = list(range(1, min(8, max_rows) + 1)), 8
    while r < max_rows:
        r = min(max_rows, r * 3 // 2)
        rows.append(r)
    return rows


def side_rows(max_rows: int) -> list[int]:
    """Draft / commit sample rows: a few points up to max_rows."""
    return sorted({r for r in (1, 2, 4, 8, 16, 32, max_rows) if r <= max_rows})


class _Rows(NamedTuple):
    """Profile rows unlike each other (module docstring), the same on every rank (a fixed seed)."""

    tokens: np.ndarray  # int64 [n]
    hiddens: np.ndarray  # float32 [n, H], unit variance: a hidden state's scale after the final norm


def _rows(n: int, hidden: int, vocab: int) -> _Rows:
    rng = np.random.default_rng(0)
    return _Rows(rng.integers(0, vocab, n, dtype=np.int64), rng.standard_normal((n, hidden), dtype=np.float32))


def _main_input(rows: int, per_request: int, width: int, like: _Rows) -> MainInput:
    """rows live rows in requests of up to per_request rows each, every table all null block."""
    q = [per_request] * (rows // per_request) + ([rows % per_request] if rows % per_request else [])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in q])
    tables = np.full((len(q), width), NULL_BLOCK_ID, np.int32)
    return MainInput(like.tokens[:rows].copy(), positions, np.array(q, np.int32), np.array(q, np.int32), tables,
                     np.arange(rows, dtype=np.int64))  # fmt: skip


def _draft_input(rows: int, width: int, like: _Rows) -> DraftInput:
    zero = np.zeros(rows, np.int64)
    return DraftInput(like.hiddens[:rows].copy(), like.tokens[:rows].copy(), zero, np.ones(rows, np.int32),
                      np.full((rows, width), NULL_BLOCK_ID, np.int32))  # fmt: skip


def _commit_input(rows: int, width: int, like: _Rows) -> CommitInput:
    return CommitInput(like.hiddens[:rows].copy(), like.tokens[:rows].copy(), np.array([rows], np.int32),
                       np.zeros(1, np.int32), np.full((1, width), NULL_BLOCK_ID, np.int32))  # fmt: skip


def _time(fn: Callable[[], object], clock: Callable[[], float]) -> int:
    fn()  # warm-up: first calls of a shape pay allocation and dispatch set-up
    times = []
    for _ in range(REPEATS):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return max(1, round(min(times) * 1e6))


def profile(executor, max_num_tokens: int, max_batch: int, k_max: int, width: int, clock: Callable[[], float],
            wrap_main: Callable[[MainInput], MainInput] = lambda inp: inp) -> CostModel:  # fmt: skip
    """Time the executor's graphs (module docstring). Verify inputs are shaped like a decode step's: requests of
    k_max + 1 rows. Draft rows are limited to max_batch (one row per request), commit rows to max_num_tokens.
    wrap_main: a hybrid model's main input (no state slot read or written)."""
    hidden, vocab = executor.hidden_size, executor.vocab_size
    mains = main_rows(min(max_num_tokens, max_batch * (k_max + 1)))
    drafts, commits = side_rows(max_batch), side_rows(min(max_num_tokens, max_batch * (k_max + 1)))
    rows = _rows(max(mains[-1], drafts[-1], commits[-1]), hidden, vocab)
    # each input is built once, outside the timed calls
    main = [_time(partial(executor.run_main, wrap_main(_main_input(r, k_max + 1, width, rows))), clock) for r in mains]
    draft = [_time(partial(executor.run_draft, _draft_input(r, width, rows)), clock) for r in drafts]
    commit = [_time(partial(executor.run_commit, _commit_input(r, width, rows)), clock) for r in commits]
    return CostModel(CostCurve(tuple(mains), monotone(main)), CostCurve(tuple(drafts), monotone(draft)),
                     CostCurve(tuple(commits), monotone(commit)))  # fmt: skip


def agree(model: CostModel, gather: Callable[[np.ndarray], list[np.ndarray]]) -> CostModel:
    """Every rank's figures -> the elementwise maximum, identical on every rank (gather: an allgather)."""
    stacked = np.max(np.stack([np.asarray(a, np.int64) for a in gather(model.to_array())]), axis=0)
    return model.with_micros([int(u) for u in stacked])
