"""Factories for runtime tests: engines over tiny random models, and a write-recording executor."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from models.testing import random_model, tiny_config
from runtime.core.config import RuntimeConfig
from runtime.core.engine import LLMEngine
from runtime.executors.torch_executor import TorchExecutor

_MODELS: dict = {}


def cached_model(seed: int = 3, **overrides):
    key = (seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        cfg = tiny_config(**overrides)
        _MODELS[key] = (cfg, random_model(cfg, seed))
    return _MODELS[key]


def make_engine(k: int, model=None, executor_cls=TorchExecutor, wrap=None, draft_length=None, verify_lengths=None,
                **rc) -> LLMEngine:  # fmt: skip
    """wrap: wraps the executor before the engine is built (recording, fault injection); draft_length: a
    DraftLengthController in place of auto's own; verify_lengths: a per-request k_i policy (verify_lengths.py)."""
    cfg, m = model or cached_model()
    defaults = dict(max_batch=4, max_num_tokens=64, max_seq_len=128, block_size=4, num_blocks=200, num_draft_tokens=k)
    defaults.update(rc)
    rcfg = RuntimeConfig(**defaults)
    executor = executor_cls(m, rcfg.num_blocks, rcfg.block_size)
    return LLMEngine(wrap(executor) if wrap else executor, cfg, rcfg, draft_length=draft_length,
                     verify_lengths=verify_lengths)


def make_recorded_engine(k: int, **kw) -> tuple[LLMEngine, RecordingExecutor]:
    """make_engine with a RecordingExecutor around its executor that checks writes against the engine's KV."""
    made: list[RecordingExecutor] = []
    engine = make_engine(k, wrap=lambda ex: made.append(RecordingExecutor(ex)) or made[0], **kw)
    made[0].kv = engine.kv
    return engine, made[0]


def random_prompts(lengths, vocab=96, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@dataclass
class Write:
    step: int
    kind: str  # "main" | "commit" | "draft{d}"
    plane: str  # "main" | "mtp"
    block: int
    slot: int
    position: int
    row: int  # request row in that forward
    token: int  # token whose embedding went into the entry (draft/commit: t_{p+1}; main: t_p)
    hidden_source: str  # "main" (a main-model hidden) or "chained" (a previous draft depth's output)


@dataclass
class RecordingExecutor:
    """Wraps a real executor; records every KV write's (block, slot, plane) with its provenance."""

    inner: TorchExecutor
    writes: list[Write] = field(default_factory=list)
    step: int = 0
    depth: int = 0
    kv: object = None  # KVCacheManager: when set, every write is checked at write time (invariant 8)
    ownership_violations: list = field(default_factory=list)
    segment_violations: list = field(default_factory=list)  # invariant 5: one commit segment per request
    num_main_requests: int = 0
    commit_requests: int = 0  # segments in this step's commit calls (a step's commits partition its requests)
    max_commit_rows: int = 0  # the most rows any one commit call carried
    commit_calls: int = 0  # commit calls of the current step

    @property
    def hidden_size(self):
        return self.inner.hidden_size

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def _record(self, kind, plane, counts, starts, tables, tokens, source):
        row = 0
        bs = self.inner.geom.block_size
        for r, (n, s0) in enumerate(zip(counts.tolist(), starts.tolist(), strict=True)):
            for j in range(n):
                pos = s0 + j
                block = int(tables[r, pos // bs])
                if self.kv is not None and (block < 1 or self.kv.pool.ref_count(block) != 1
                                            or self.kv.pool.is_published(block)):  # fmt: skip
                    self.ownership_violations.append((self.step, kind, block, pos))
                self.writes.append(Write(self.step, kind, plane, block, pos % bs, pos, r, int(tokens[row]), source))
                row += 1

    def run_main(self, inp):
        if self.commit_requests not in (0, self.num_main_requests):  # the previous step's commits
            self.segment_violations.append((self.step, self.commit_requests, self.num_main_requests))
        self.commit_requests = self.commit_calls = 0
        self.step += 1
        self.depth = 0
        self.num_main_requests = len(inp.q_counts)
        starts = inp.kv_lens - inp.q_counts
        self._record("main", "main", inp.q_counts, starts, inp.block_tables, inp.input_ids, "main")
        return self.inner.run_main(inp)

    def run_commit(self, inp):
        self.commit_requests += len(inp.counts)
        self.commit_calls += 1
        if self.commit_requests > self.num_main_requests or len(inp.starts) != len(inp.counts):
            self.segment_violations.append((self.step, len(inp.counts), self.num_main_requests))
        self.max_commit_rows = max(self.max_commit_rows, len(inp.token_ids))
        self._record("commit", "mtp", inp.counts, inp.starts, inp.block_tables, inp.token_ids, "main")
        return self.inner.run_commit(inp)

    def run_draft(self, inp):
        live = inp.counts.astype(bool)
        self._record(f"draft{self.depth}", "mtp", inp.counts, inp.positions, inp.block_tables,
                     inp.token_ids[live] if live.all() else inp.token_ids, "main" if self.depth == 0 else "chained")  # fmt: skip
        self.depth += 1
        return self.inner.run_draft(inp)

    def copy_blocks(self, pairs):
        """Copy-on-write copies every plane of a block: the copy inherits the source's entries (and provenance)."""
        for src, dst in pairs:
            latest = {}
            for w in self.writes:
                if w.block == src:
                    latest[(w.plane, w.slot)] = w
            for w in latest.values():
                self.writes.append(Write(self.step, "copy", w.plane, dst, w.slot, w.position, w.row, w.token,
                                         w.hidden_source))  # fmt: skip
        return self.inner.copy_blocks(pairs)


def np_equal(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


LOSSLESS_LIMITS = dict(block_size=4, num_blocks=200, max_batch=4, max_num_tokens=64, max_seq_len=128)


def greedy_run(path, k: int, prompts: list[list[int]], params, **rc) -> tuple[list[list[int]], LLMEngine]:
    """The family lossless tests' run: a checkpoint on the torch executor at K=k (runtime overrides in rc); the
    output ids per prompt and the engine, after checking no KV block leaked."""
    from runtime.factory import create_engine

    engine = create_engine(checkpoint=path, executor="torch", **{**LOSSLESS_LIMITS, "num_draft_tokens": k, **rc})
    outs = engine.generate(prompts, params)
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1, "KV blocks leaked"
    return [o.output_ids for o in outs], engine


def hf_greedy_ids(model_cls, path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` of each prompt (one at a time), the ids after the prompt."""
    hf = model_cls.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False) for p in prompts]
    return [out[0, len(p) :].tolist() for p, out in zip(prompts, outs, strict=True)]

