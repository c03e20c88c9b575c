"""The draft loop's host path (runtime/core/draft_loop.py) and the compiled executor's call glue, without a model.

The draft loop serves requests that draft by argmax with one batched argmax per depth and the others row by row:
its drafts (and draft probs) must be exactly the per-row `draft_token` chain's, for any mix of policies and ragged
k_i. The compiled executor reuses its input views per shape: each call must hand the package exactly this call's
inputs, whatever shapes came before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.engine_format.graph_io import graph_spec
from runtime.core import draft_loop
from runtime.core.mtp_plan import RequestUpdate
from runtime.core.request import Request
from runtime.core.sampling import SamplingParams, draft_token
from runtime.executors.base import DraftInput, DraftOutput
from runtime.executors.compiled_executor import ExecutionContext

V, H = 50, 4


def _logits(token: int, position: int) -> np.ndarray:
    """A depth's logits for one row, a function of the row alone (so the batch around it does not matter)."""
    return np.random.default_rng(token * 1009 + position).standard_normal(V).astype(np.float32)


def _fake_draft(inp: DraftInput) -> DraftOutput:
    logits = np.stack([_logits(int(t), int(p)) for t, p in zip(inp.token_ids, inp.positions, strict=True)])
    return DraftOutput(inp.hidden_in + 1, logits.reshape(-1, V))


POLICIES = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, seed=1),  # sampled, exact-match acceptance: drafts the argmax
    SamplingParams(temperature=0.8, top_k=5, seed=2, acceptance="rejection"),  # sampled drafts and their probs
    SamplingParams(temperature=0.0, acceptance="rejection"),  # greedy whatever the acceptance
    SamplingParams(temperature=1.2, top_p=0.9, seed=3, acceptance="rejection"),
]


def _requests() -> list[Request]:
    reqs = []
    for i, p in enumerate(POLICIES):
        reqs.append(Request(f"r{i}", list(range(3, 10 + i)), p, i, np.random.default_rng(p.seed)))
    return reqs


def _expected(r: Request, k: int) -> tuple[list[int], list[np.ndarray]]:
    """The per-row chain: depth d drafts from its own logits with draft_token (the loop's reference)."""
    rng, token, base, drafts, probs = np.random.default_rng(r.params.seed), r.token_ids[-1], r.num_tokens - 1, [], []
    for depth in range(k):
        token = draft_token(r.params, rng, _logits(token, base - 1 + depth)[None], probs)
        drafts.append(token)
    return drafts, probs


@pytest.mark.parametrize("k_i", [[3] * 5, [3, 0, 2, 1, 3], [1, 3, 3, 2, 0]])
def test_batched_argmax_drafts_equal_the_per_row_chain(k_i):
    reqs, k = _requests(), max(k_i)
    updates = [RequestUpdate(r.num_tokens - 1, [], 0, None, j) for j, r in enumerate(reqs)]
    tables = np.zeros((len(reqs), 2), np.int32)
    calls: list[int] = []

    def run_draft(inp: DraftInput) -> DraftOutput:
        calls.append(len(inp.token_ids))
        return _fake_draft(inp)

    failed = draft_loop.run(run_draft, lambda: calls.append(0), reqs, updates, np.zeros((len(reqs), H)), tables, k_i, k)
    assert failed == {}
    assert calls == [sum(n > d for n in k_i) for d in range(k)]  # one call per depth, the shrinking rows
    for r, n in zip(reqs, k_i, strict=True):
        drafts, probs = _expected(r, n)
        assert r.spec.drafts == drafts, r.params
        if probs:
            np.testing.assert_array_equal(r.spec.draft_probs, np.stack(probs))
        else:
            assert r.spec.draft_probs is None


def _context() -> ExecutionContext:
    spec = graph_spec("mtp_draft", False)
    limits = {"hidden_in": 4 * H, "token_ids": 4, "positions": 4, "counts": 4, "block_tables": 4 * 3}
    buffers = {n: torch.zeros(limits[n], dtype=getattr(torch, spec.dtypes[n])) for n in spec.step_inputs}
    seen: list[list[torch.Tensor]] = []
    ctx = ExecutionContext(spec, lambda args: seen.append([a.clone() for a in args]) or args, buffers,
                           {n: b.numpy() for n, b in buffers.items()}, [torch.zeros(1)])  # fmt: skip
    ctx.seen = seen  # type: ignore[attr-defined]
    return ctx


def test_compiled_call_hands_the_package_this_calls_inputs():
    ctx = _context()
    for rows in (3, 1, 3, 0, 4, 1):
        inp = DraftInput(np.arange(rows * H, dtype=np.float32).reshape(rows, H) + rows, np.arange(rows) + 7 * rows,
                         np.arange(rows) + 2, np.ones(rows, np.int32), np.full((rows, 3), rows, np.int32))  # fmt: skip
        ctx(inp)
        args = ctx.seen[-1]  # type: ignore[attr-defined]
        for name, arg in zip(ctx.spec.step_inputs, args, strict=False):
            np.testing.assert_array_equal(arg.numpy(), getattr(inp, name), err_msg=f"{rows} rows: {name}")
    too_many = DraftInput(np.zeros((5, H), np.float32), np.zeros(5, np.int64), np.zeros(5, np.int64),
                          np.zeros(5, np.int32), np.zeros((5, 3), np.int32))  # fmt: skip
    with pytest.raises(ValueError, match="limits allow"):
        ctx(too_many)
