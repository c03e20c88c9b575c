"""The draft loop in one call (builder/fused_draft.py, issue 27) of a compiled engine: the build writes and checks
the fused package, it drafts and writes exactly what the per-depth loop does with ragged k_i (a row with k_i = 0 and a
padding row among them), and greedy decoding through it stays token-identical to K=0 of the same engine.

The compiled build of test_compiled_engine.py (tests/builder/conftest.py `compiled_build`: the default build, which
is aoti here, K=3) serves every test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder import cli
from models.engine_format import load_engine_config
from models.engine_format.graph_io import DRAFT_GRAPH, FUSED_DRAFT, FUSED_KIND
from runtime.core import draft_loop
from runtime.core.mtp_plan import RequestUpdate, plan_fused_draft
from runtime.core.request import Request
from runtime.core.sampling import SamplingParams
from runtime.core.verify_lengths import FixedPattern
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.factory import create_engine
from tests.builder.conftest import COMPILED_K
from tests.runtime.engine_utils import random_prompts

K = COMPILED_K
PROMPTS = random_prompts((5, 13, 9, 22, 3, 17), seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PARAMS = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def compiled(compiled_build):
    return compiled_build[0]


def test_build_records_and_checks_the_fused_package(compiled, capsys):
    cfg = load_engine_config(compiled)
    rel = cfg.graphs[0][DRAFT_GRAPH][FUSED_KIND]
    assert rel == f"rank0/{DRAFT_GRAPH}.{FUSED_KIND}.pt2" and rel in cfg.files  # checksummed
    assert cfg.build["compiled"]["graphs"][FUSED_DRAFT]["seconds"] > 0
    assert CompiledExecutor(compiled).fused_draft_depths == K
    assert cli.main(["--check", str(compiled)]) == 0  # its probe runs the fused package against the torch model
    assert "match the torch model" in " ".join(capsys.readouterr().out.split())


class Batch:
    """Greedy requests at their own base positions, each with blocks of its own (block 0 is the null block)."""

    def __init__(self, ex: CompiledExecutor, n: int) -> None:
        rng = np.random.default_rng(n)
        bs, width = ex.config.kv.block_size, ex.config.kv.table_width
        self.bases = [9 + 6 * i for i in range(n)]
        self.tables = np.full((n, width), -1, dtype=np.int32)
        nxt = 1
        for i, b in enumerate(self.bases):
            used = -(-(b + K + 1) // bs)
            self.tables[i, :used] = np.arange(nxt, nxt + used)
            nxt += used
        self.prompts = [rng.integers(0, ex.vocab_size, b + 1).tolist() for b in self.bases]
        self.hidden = rng.standard_normal((n, ex.hidden_size)).astype(np.float32)
        self.updates = [RequestUpdate(b, [], 0, None, i) for i, b in enumerate(self.bases)]

    def drafts(self, ex: CompiledExecutor, k_i: list[int], fused: bool) -> list[list[int]]:
        reqs = [Request(f"r{i}", p, SamplingParams(), i, np.random.default_rng(i)) for i, p in enumerate(self.prompts)]
        failed = draft_loop.run(ex.run_draft, lambda: pytest.fail("no depth is empty here"), reqs, self.updates,
                                self.hidden, self.tables, k_i, K, ex.run_fused_draft if fused else None)  # fmt: skip
        assert not failed
        return [r.spec.drafts for r in reqs]


def _same_writes(pool: torch.Tensor, want: torch.Tensor, initial: torch.Tensor) -> None:
    """Outside the null block (where rows past their k_i write): the same slots written, with the same values up to
    summation order (a depth's GEMMs see all R rows here, only the live ones per depth: the last bits may differ)."""
    written = (pool != initial).flatten(4).any(-1)[:, :, 1:]  # [plane, k/v, block, slot]
    assert torch.equal(written, (want != initial).flatten(4).any(-1)[:, :, 1:])
    assert float((pool[:, :, 1:] - want[:, :, 1:]).abs().max()) < 1e-5


def test_fused_drafts_and_writes_what_the_per_depth_loop_does(compiled):
    """Ragged k_i (3 deep, 0 deep, 2 deep): the same drafts, k_i of them each, and the same writes but in the null
    block; then the same call with a padding row (count 0) after them."""
    ex = CompiledExecutor(compiled)
    ex.pool.normal_(generator=torch.Generator().manual_seed(0))  # the history every depth attends to
    initial = ex.pool.clone()
    batch, k_i = Batch(ex, 3), [3, 0, 2]
    per_depth = batch.drafts(ex, k_i, fused=False)
    want = ex.pool.clone()
    assert [len(d) for d in per_depth] == k_i
    written = (want != initial).flatten(3).any(-1)  # [plane, k/v, block]: the blocks each form wrote
    assert written[:, :, 1:].any() and not written[:, :, 0].any()
    ex.pool.copy_(initial)
    assert batch.drafts(ex, k_i, fused=True) == per_depth
    _same_writes(ex.pool, want, initial)  # no request's block written past its k_i

    ex.pool.copy_(initial)
    inp = plan_fused_draft(batch.hidden, [p[-1] for p in batch.prompts], batch.bases, batch.tables, k_i)
    pad = np.full((1, batch.tables.shape[1]), -1, np.int32)
    pad[0, 0] = 0
    padded = type(inp)(np.concatenate([inp.hidden_in, np.zeros_like(inp.hidden_in[:1])]),
                       np.append(inp.token_ids, 0), np.append(inp.positions, 0), np.append(inp.counts, 0),
                       np.concatenate([inp.block_tables, pad]), np.append(inp.depths, K))  # fmt: skip
    drafts = ex.run_fused_draft(padded)
    assert drafts.shape == (4, K) and [row[:n] for row, n in zip(drafts.tolist(), k_i, strict=False)] == per_depth
    _same_writes(ex.pool, want, initial)


def _run(engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, PARAMS)
    engine.kv.assert_no_leaks()
    return [o.output_ids for o in outs]


@pytest.fixture(scope="module")
def reference(compiled):
    return _run(create_engine(compiled, executor="compiled", num_draft_tokens=0))


@pytest.mark.parametrize("policy", ["fixed", "per-request", "forced"])
def test_greedy_through_the_fused_loop_is_lossless(compiled, reference, policy):
    """K=3 fixed, the default per-request policy and forced ragged lengths (k_i 3, 0, 1, 2 in turn), with prefill
    chunks shorter than the prompts and a prefix-cache hit: the ids of K=0, and the fused package really ran (but
    per-request: on this random tiny checkpoint its drafts are never accepted, so the policy soon stops drafting)."""
    kw = {"fixed": dict(num_draft_tokens=K), "per-request": dict(num_draft_tokens="per-request"),
          "forced": dict(num_draft_tokens=K, verify_lengths=FixedPattern((3, 0, 1, 2)))}[policy]  # fmt: skip
    engine = create_engine(compiled, executor="compiled", max_prefill_chunk=5, **kw)
    ctx, calls = engine.executor.contexts[FUSED_DRAFT], []
    real = ctx.run
    ctx.run = lambda args: calls.append(len(args[0])) or real(args)
    assert _run(engine) == reference
    assert engine.metrics.prefix_hit_tokens > 0
    if policy != "per-request":
        assert calls and engine.metrics.mean_acceptance_length > 1.0  # the fused drafts were really verified


def test_switched_off_it_never_runs(compiled, reference):
    engine = create_engine(compiled, executor="compiled", num_draft_tokens=K, fused_draft=False)
    assert _run(engine) == reference
    assert FUSED_DRAFT not in engine.executor.contexts  # not even loaded: it costs memory


def test_lockstep_ranks_and_the_switch_keep_one_call_per_depth(compiled):
    """The engine's choice (draft_loop.fused_call): the package's depth and call alone and on; nothing under lockstep
    (mpirun ranks must issue the same forwards whatever one rank's rows draft by) or switched off."""
    ex = CompiledExecutor(compiled)
    assert draft_loop.fused_call(ex, True, False) == (K, ex.run_fused_draft)
    assert draft_loop.fused_call(ex, True, True) == draft_loop.fused_call(ex, False, False) == (0, None)
