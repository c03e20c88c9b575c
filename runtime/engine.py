"""LLMEngine: continuous batching + the exact MTP speculative step, over any executor.

One `step()` (design section 4):
  1. schedule      which requests forward how many tokens (runtime/scheduler.py)
  2. verify        one main forward over the packed batch; main KV appended inside
  3. accept        greedy / exact-match / rejection sampling -> a_r accepted drafts + one new token
  4. rewind        bookkeeping only: num_computed = base; lookahead blocks stay owned
  5. commit pass   one packed varlen K/V write of the MTP plane from main hiddens (runtime/mtp_plan.py)
  6. draft loop    k serial MTP depths from (h_{base-1}, base token); drafts verified next step
  7. emit          stream new tokens, stop conditions, free finished requests, publish full blocks

The engine knows nothing about torch or ONNX Runtime: executors take and return numpy arrays.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from models.config import ModelConfig
from runtime.admission import RequestError, validate_params, validate_prompt, validate_request_id
from runtime.config import ConfigError, RuntimeConfig
from runtime.executors.base import DraftInput, Executor, MainInput
from runtime.kv_manager import KVCacheManager
from runtime.metrics import Metrics
from runtime.mtp_plan import commit_segment, pack_commit, plan_draft, plan_main, table_array
from runtime.request import ChunkCarry, Request, RequestStatus
from runtime.sampling import (
    SamplingParams,
    accept_exact_match,
    accept_greedy,
    accept_rejection,
    probs_from_logits,
    sample,
)
from runtime.scheduler import ScheduledRequest, Scheduler


@dataclass(slots=True)
class RequestOutput:
    req_id: str
    new_token_ids: list[int]  # emitted this step (stream these)
    output_ids: list[int]  # all generated ids so far
    text: str  # detokenized output so far ("" without a tokenizer)
    finished: bool
    finish_reason: str | None
    num_steps: int
    accepted_per_step: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, executor: Executor, model_cfg: ModelConfig, cfg: RuntimeConfig, tokenizer=None,
                 lockstep: bool = False) -> None:  # fmt: skip
        if cfg.num_draft_tokens > 0 and model_cfg.num_mtp_modules == 0:
            raise ConfigError("this model has no MTP module; run with --num-draft-tokens 0")
        self.executor, self.model_cfg, self.cfg, self.tokenizer = executor, model_cfg, cfg, tokenizer
        self.k = cfg.num_draft_tokens
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 mtp_cow=cfg.prefix_cache_cow, draft_kv=self.k > 0)  # fmt: skip
        self.scheduler = Scheduler(cfg, self.kv)
        self.metrics = Metrics(self.k)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._rng = np.random.default_rng(0)
        self.width = cfg.max_blocks_per_request
        # Multi-rank expert parallelism: every rank must issue the same collective-bearing forwards each step
        # (1 main + k drafts), so an idle rank runs dummy forwards that touch only the null block (invariant 9).
        self.lockstep = lockstep
        self._exec_seconds = 0.0  # executor time within the current step

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, req_id: str | None = None) -> str:
        """Validate and queue a request. Raises RequestError (naming the problem) and changes nothing."""
        params = validate_params(params, self.model_cfg.vocab_size)
        req_id = validate_request_id(req_id)
        req_id = req_id if req_id is not None else f"req-{next(self._arrivals)}"
        if req_id in self.requests:
            raise RequestError(f"request id {req_id!r} is already in use; pick a unique id")
        ids = validate_prompt(prompt, self.tokenizer, self.model_cfg.vocab_size, self.cfg.max_seq_len)
        worst_blocks = self.width
        if worst_blocks > self.cfg.num_blocks - 1:
            raise RequestError(f"a request may need {worst_blocks} KV blocks but the pool has {self.cfg.num_blocks - 1}")
        req = Request(req_id, ids, params, next(self._arrivals))
        req.rng = np.random.default_rng(params.seed) if params.seed is not None else self._rng
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req_id

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is not None and not req.is_finished:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        self._exec_seconds = 0.0
        sched = self.scheduler.schedule()
        self.metrics.num_preemptions += len(sched.preempted)
        if sched.block_copies:  # prefix-cache copy-on-write, before anything reads the copies
            self.executor.copy_blocks(sched.block_copies)
            self.kv.complete_copies()
        if not sched.scheduled:
            if self.lockstep:
                self._dummy_forwards(main=True)
            return []
        scheduled = sched.scheduled
        tables = table_array([self.kv.block_table(s.req.req_id) for s in scheduled], self.width)
        plan = plan_main(scheduled, tables)
        main = self._timed(self.executor.run_main, plan.inp)  # 1. verify (main KV appended inside)
        accepted, emitted = self._accept_all(scheduled, plan, main.logits)  # 2. accept
        if self.k:
            self._commit_pass(scheduled, accepted, main.hidden, plan.row_offsets, tables)  # 4. commit pass
        outputs, drafting = self._advance(scheduled, plan, main.hidden, accepted, emitted)  # 3. rewind, 6. emit
        if self.k:  # 5. serial draft loop from h_{base-1} and the new base token
            rows = [row for _, row in drafting]
            self._draft_loop([scheduled[i].req for i, _ in drafting], main.hidden[rows],
                             tables[[i for i, _ in drafting]])  # fmt: skip
        self._publish(scheduled)
        self._update_metrics(time.perf_counter() - t_start, self._exec_seconds)
        return outputs

    def _timed(self, fn, *args):
        """Call an executor method, adding its time to this step's executor time."""
        t0 = time.perf_counter()
        out = fn(*args)
        self._exec_seconds += time.perf_counter() - t0
        return out

    def _accept_all(self, scheduled: list[ScheduledRequest], plan, logits: np.ndarray):
        """Per request: accepted draft count a_r and the tokens to emit (accepted drafts + one main token)."""
        accepted: list[int] = []
        emitted: list[list[int]] = []
        for i, s in enumerate(scheduled):
            if not s.reaches_end:  # a non-final prefill chunk samples nothing
                accepted.append(0)
                emitted.append([])
                continue
            lo = plan.logit_offsets[i]
            a, nxt = self._accept(s.req, logits[lo : lo + 1 + s.num_drafts])
            accepted.append(a)
            emitted.append(s.req.drafts[:a] + [nxt])
        return accepted, emitted

    def _advance(self, scheduled: list[ScheduledRequest], plan, hidden: np.ndarray, accepted: list[int],
                 emitted: list[list[int]]) -> tuple[list[RequestOutput], list[tuple[int, int]]]:  # fmt: skip
        """Rewind (bookkeeping only), carry chunk seams, emit tokens. Returns outputs and the requests that
        draft next, as (index in scheduled, main row of h_{base-1})."""
        outputs, drafting = [], []
        for i, s in enumerate(scheduled):
            req = s.req
            req.num_computed = s.start + s.num_new_tokens + accepted[i]  # lookahead blocks stay owned
            req.drafts, req.draft_probs = [], None
            if not s.reaches_end:
                last = plan.row_offsets[i] + s.num_new_tokens - 1
                req.carry = ChunkCarry(s.start + s.num_new_tokens - 1, hidden[last].copy()) if self.k else None
                continue
            req.carry = None
            self._record_verify(s, accepted[i])
            new = self._emit(req, emitted[i])
            outputs.append(self._output(req, new))
            if not req.is_finished and self.k:
                drafting.append((i, plan.row_offsets[i] + s.num_new_tokens - 1 + accepted[i]))
        return outputs, drafting

    def _publish(self, scheduled: list[ScheduledRequest]) -> None:
        """Publish blocks whose main and MTP entries are final (a carried position is not final yet)."""
        for s in scheduled:
            if not s.req.is_finished:
                final = s.req.num_computed - (1 if s.req.carry is not None else 0)
                self.kv.publish_full_blocks(s.req.req_id, s.req.token_ids, final)

    def _accept(self, req: Request, rows: np.ndarray) -> tuple[int, int]:
        """rows [1+k, V]: logits of the last real token and of each draft."""
        p = req.params
        if p.is_greedy:
            return accept_greedy(req.drafts, rows.argmax(-1).tolist())
        probs = probs_from_logits(rows, p)
        if p.acceptance == "rejection" and req.drafts and req.draft_probs is not None:
            return accept_rejection(req.drafts, req.draft_probs, probs, req.rng)
        return accept_exact_match(req.drafts, sample(probs, req.rng).tolist())

    def _commit_pass(self, scheduled: list[ScheduledRequest], accepted: list[int], hidden: np.ndarray,
                     row_offsets: list[int], tables: np.ndarray) -> None:  # fmt: skip
        segments = []
        for i, s in enumerate(scheduled):
            carry = s.req.carry
            if carry is not None and carry.position != s.start - 1:
                raise RuntimeError(f"chunk carry of {s.req.req_id} is for position {carry.position}, "
                                   f"but the next chunk starts at {s.start}")  # fmt: skip
            committed = s.req.token_ids + s.req.drafts[: accepted[i]]
            segments.append(commit_segment(s, accepted[i], committed, hidden, row_offsets[i],
                                           None if carry is None else carry.hidden, self.cfg.commit_pass))  # fmt: skip
        inp = pack_commit(segments, tables, self.executor.hidden_size)
        if len(inp.token_ids):  # no collective inside, so skipping an empty write keeps lockstep
            self._timed(self.executor.run_commit, inp)

    def _dummy_forwards(self, main: bool) -> None:
        """One padded row (count 0, null block): joins the MoE exchange, reads and writes no KV."""
        table = np.full((1, self.width), -1, dtype=np.int32)
        table[0, 0] = 0
        zero_i32, zero_i64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
        if main:
            self.executor.run_main(MainInput(zero_i64, zero_i64, zero_i32, zero_i32, table, np.zeros(0, np.int64)))
        hidden = np.zeros((1, self.executor.hidden_size), np.float32)
        for _ in range(self.k):
            self.executor.run_draft(DraftInput(hidden, zero_i64, zero_i64, zero_i32, table))

    def _draft_loop(self, reqs: list[Request], hidden: np.ndarray, tables: np.ndarray) -> None:
        if not reqs:
            if self.lockstep:
                self._dummy_forwards(main=False)
            return
        bases = [r.num_computed for r in reqs]
        for r, b in zip(reqs, bases, strict=True):
            if r.num_tokens - 1 != b:
                raise RuntimeError(f"{r.req_id}: base position {b} is not the last token's ({r.num_tokens - 1})")
        tokens = [r.token_ids[-1] for r in reqs]
        probs: list[list[np.ndarray]] = [[] for _ in reqs]
        for depth in range(self.k):
            out = self._timed(self.executor.run_draft, plan_draft(hidden, tokens, bases, depth, tables))
            tokens = []
            for j, r in enumerate(reqs):
                if r.params.acceptance == "rejection" and not r.params.is_greedy:
                    q = probs_from_logits(out.logits[j : j + 1], r.params)
                    probs[j].append(q[0])
                    tokens.append(int(sample(q, r.rng)[0]))
                else:
                    tokens.append(int(out.logits[j].argmax()))
                r.drafts.append(tokens[-1])
            hidden = out.hidden_out
        for j, r in enumerate(reqs):
            if probs[j]:
                r.draft_probs = np.stack(probs[j])

    # ------------------------------------------------------------------ emission and bookkeeping
    def _emit(self, req: Request, tokens: list[int]) -> list[int]:
        p = req.params
        stop_ids = {p.end_id} if p.end_id is not None else set(self.model_cfg.eos_token_id)
        new = []
        for t in tokens:
            req.output_ids.append(t)
            new.append(t)
            self.metrics.num_generated_tokens += 1
            if self.tokenizer is not None and p.stop:  # stop strings are checked token by token
                req.text = self.tokenizer.decode(req.output_ids)
            if t in stop_ids:
                self._finish(req, "stop")
            elif p.stop and any(s in req.text for s in p.stop):
                cut = min(req.text.find(s) for s in p.stop if s in req.text)
                req.text = req.text[:cut]
                self._finish(req, "stop")
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_seq_len:
                self._finish(req, "length")
            if req.is_finished:
                break
        if self.tokenizer is not None and not p.stop:
            req.text = self.tokenizer.decode(req.output_ids)  # once per step, not once per emitted token
        return new

    def _finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.scheduler.finish(req)

    def _record_verify(self, s: ScheduledRequest, a: int) -> None:
        is_decode = s.num_drafts > 0 or (self.k == 0 and s.num_new_tokens == 1 and bool(s.req.output_ids))
        if is_decode:
            s.req.num_steps += 1
            s.req.accepted_per_step.append(a)
            self.metrics.record_verify(s.num_drafts, a, a + 1)

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(req.req_id, new, list(req.output_ids), req.text, req.is_finished, req.finish_reason,
                             req.num_steps, list(req.accepted_per_step))  # fmt: skip

    def _update_metrics(self, step_seconds: float, exec_seconds: float) -> None:
        m = self.metrics
        m.num_steps += 1
        m.step_seconds += step_seconds
        m.executor_seconds += exec_seconds
        m.prefix_hit_tokens = self.kv.stats.num_hit_tokens
        m.kv_blocks_used, m.kv_blocks_free = self.kv.num_used_blocks, self.kv.num_free_blocks
        m.kv_blocks_used_peak = max(m.kv_blocks_used_peak, m.kv_blocks_used)

    # ------------------------------------------------------------------ convenience
    def stream(self) -> Iterator[RequestOutput]:
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns the final output of each, in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        final: dict[str, RequestOutput] = {}
        for out in self.stream():
            if out.finished:
                final[out.req_id] = out
        return [final[i] for i in ids]
