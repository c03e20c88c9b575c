"""LLMEngine: continuous batching + the exact MTP speculative step, over any executor.

One `step()` is plan, then apply; the phases run in this order and no other:
  1. schedule   which requests forward how many tokens (runtime/core/scheduler.py)
  2. verify     one main forward over the packed batch (plan_main); main KV appended inside
  3. accept     greedy / exact-match / rejection sampling -> a_r accepted drafts + one main token
                (runtime/core/accept.py); then this step's draft length k (fixed K, or `auto`:
                runtime/core/draft_length.py, same on all ranks)
  4. plan       plan_step (runtime/core/mtp_plan.py, pure): commit input, chunk carries, rewinds (bases),
                emitted tokens and draft rows, all from the verify results before any state changes
                (k = 0: depth 0's entry at base-1 is carried to a later commit, or dropped once auto gives up)
  5. commit     one packed varlen write of the MTP plane from main hiddens (the plan's commit input)
  6. apply      per request: rewind num_computed to base (bookkeeping only; lookahead blocks stay owned),
                set or clear the chunk carry, drop the verified drafts, emit tokens, stop conditions
  7. draft      k serial MTP depths for the requests still running, from (h_{base-1}, base token)
  8. publish    full verified blocks into the prefix cache
Commit (5) reads only the plan, so its order against apply (6) does not matter; draft (7) needs both.
Each step fills one StepRecord (runtime/core/step_record.py: phase times, rows per graph call, k and accepted
drafts per request) and publishes it at its end; auto's cost cycles, the metrics, the bench and the serving
statistics read the record, and nothing else times the step.

A failure traceable to one request (its logits, its sampling, its stop strings, an inconsistent state)
aborts that request alone with finish_reason "error"; only executor failures abort the step.
The engine knows nothing about torch or ONNX Runtime: executors take and return numpy arrays.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from models.config import ModelConfig
from runtime.core import accept, cost_model, draft_loop, logprobs, mtp_plan
from runtime.core.acceptance_guard import CollapseDetector
from runtime.core.admission import RequestError, validate_params, validate_prompt, validate_request_id
from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.draft_length import DraftLengthController, StepSample, combine
from runtime.core.kv_manager import KVCacheManager
from runtime.core.metrics import Metrics
from runtime.core.mtp_plan import MainPlan, RequestUpdate, StepPlan, plan_main, plan_step, table_array
from runtime.core.ranks import SINGLE_RANK, RankStrategy
from runtime.core.request import Request, RequestOutput, RequestStatus, request_rng
from runtime.core.sampling import SamplingParams
from runtime.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from runtime.core.state_pool import StateSlots, hybrid_runtime_config, idle_input
from runtime.core.step_record import CycleMeter, StepRecord, StepTimer
from runtime.core.verify_lengths import AcceptancePolicy, VerifyLengthPolicy
from runtime.executors.base import Executor

__all__ = ["LLMEngine", "RequestError", "RequestOutput"]


class LLMEngine:
    def __init__(self, executor: Executor, model_cfg: ModelConfig, cfg: RuntimeConfig, tokenizer=None,
                 seed: int = 0, ranks: RankStrategy = SINGLE_RANK,
                 draft_length: DraftLengthController | None = None, draft_clock=time.perf_counter,
                 executor_name: str = "", acceptance_watch: CollapseDetector | None = None,
                 verify_lengths: VerifyLengthPolicy | None = None) -> None:  # fmt: skip
        """seed: engine seed; an unseeded request samples from a generator derived from (seed, request id).
        ranks: this rank's part in an mpirun job (runtime/core/ranks.py); the default is a rank alone.
        draft_length: the controller of `auto` (default: DraftLengthController(K) when cfg asks for auto).
        draft_clock: auto's clock; wall time (the objective) by default, time.process_time for CPU executors,
            whose wall time on shared cores mostly measures the other jobs (create_engine picks).
        executor_name: which executor runs (compiled, onnxruntime, torch, tensorrt), for the summaries.
        acceptance_watch: the acceptance-collapse detector (default sizes: acceptance_guard.CollapseDetector).
        verify_lengths: per-request k_i (default: AcceptancePolicy, its costs profiled here, when cfg asks for per-request)."""
        if cfg.num_draft_tokens > 0 and model_cfg.num_mtp_modules == 0:
            raise ConfigError("this model has no MTP module; run with --num-draft-tokens 0")
        cfg = hybrid_runtime_config(cfg, executor) if model_cfg.is_hybrid else cfg
        self.model_cfg, self.cfg, self.tokenizer = model_cfg, cfg, tokenizer
        self.ranks, self.executor = ranks, ranks.executor(executor)
        self.executor_name = executor_name
        self.k, self.seed = cfg.num_draft_tokens, seed
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 mtp_cow=cfg.prefix_cache_cow, draft_kv=self.k > 0)  # fmt: skip
        # Hybrid models: K+2 recurrent-state slots per request, and the state snapshots prefix hits resume from
        self.state_slots = StateSlots.for_engine(cfg, self.kv) if model_cfg.is_hybrid else None
        self.kv.usable_prefix = self.state_slots.usable_prefix if self.state_slots is not None else None
        self.scheduler = Scheduler(cfg, self.kv)
        self.metrics = Metrics(self.k)
        self.acceptance_watch = acceptance_watch or CollapseDetector()  # warns once when acceptance collapses
        self.requests: dict[str, Request] = {}  # unfinished requests only: a finished one leaves with its output
        self._arrivals = itertools.count()
        self.width = cfg.max_blocks_per_request
        self._fused_k, self._run_fused = draft_loop.fused_call(executor, cfg.fused_draft and self.k > 0, ranks.lockstep)
        # --num-draft-tokens auto: self.k is the maximum, the controller picks each step's k (draft_length.py)
        if draft_length is None and cfg.auto_draft_tokens and self.k:
            draft_length = DraftLengthController(self.k)
        self.draft_length = draft_length
        if verify_lengths is None and cfg.per_request_draft_tokens and self.k and not ranks.is_follower:
            verify_lengths = AcceptancePolicy(self._profile_costs(draft_clock))  # a follower never chooses
        self.verify_lengths = verify_lengths
        if isinstance(verify_lengths, AcceptancePolicy):  # settled on drafting nothing: most are admitted frozen
            self.scheduler.keeps_mtp_plane = verify_lengths.keeps_mtp_plane
        # rows a request holds back while `auto` runs k = 0 (mtp_plan.plan_step): the request's whole commit segment
        # (carry + up to 2K verified rows + the tail) must fit one commit call of max_num_tokens rows
        self._max_carry_rows = max(0, min(4 * cfg.block_size, cfg.max_num_tokens - 2 * self.k - 1))
        self._cycles = CycleMeter()  # auto's cost of a draft length k: a cycle, from the step records
        self.draft_clock = draft_clock
        self._timer = StepTimer(draft_clock)  # the running step's (runtime/core/step_record.py)
        self.last_step: StepRecord | None = None  # the record of the last step (idle steps included)
        self.step_listeners: list[Callable[[StepRecord], None]] = []  # each gets every step's record
        if isinstance(self.verify_lengths, AcceptancePolicy) and not ranks.lockstep:  # host costs, learnt online
            self.step_listeners.append(self.verify_lengths.observe)

    def _profile_costs(self, clock: Callable[[], float]) -> cost_model.CostModel:
        """The per-request policy's step cost model, timed now on this executor's graphs (runtime/core/cost_model.py);
        lockstep ranks each time the same calls (collectives inside) and agree on the figures."""
        wrap = idle_input if self.state_slots is not None else (lambda inp: inp)
        model = cost_model.profile(self.executor, self.cfg.max_num_tokens, self.cfg.max_batch, self.k, self.width,
                                   clock, wrap)  # fmt: skip
        return cost_model.agree(model, self.ranks.gather_draft_samples) if self.ranks.lockstep else model

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, req_id: str | None = None) -> str:
        """Validate and queue a request. Raises RequestError (naming the problem) and changes nothing."""
        params = validate_params(params, self.model_cfg.vocab_size)
        req_id = validate_request_id(req_id)
        req_id = req_id if req_id is not None else f"req-{next(self._arrivals)}"
        if req_id in self.requests:
            raise RequestError(f"request id {req_id!r} is already in use; pick a unique id")
        ids = validate_prompt(prompt, self.tokenizer, self.model_cfg.vocab_size, self.cfg.max_seq_len)
        if self.width > self.cfg.num_blocks - 1:
            raise RequestError(f"a request may need {self.width} KV blocks but the pool has {self.cfg.num_blocks - 1}")
        req = Request(req_id, ids, params, next(self._arrivals), request_rng(self.seed, req_id, params.seed))
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req_id

    def abort(self, req_id: str) -> None:
        """Stop a request now (no further output for it); unknown or finished ids are ignored."""
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, "abort")

    def reset_metrics(self) -> None:
        """Fresh counters (the benchmarks measure each run apart), and a fresh running average of acceptance."""
        self.metrics = Metrics(self.k)
        self.acceptance_watch.reset()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def awaiting_first_token(self, req_ids: Iterable[str]) -> bool:
        """Whether one of these requests is unfinished with no output token yet (still prefilling)."""
        return any(not self.requests[i].output_ids for i in req_ids if i in self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        self.ranks.begin_step()
        try:
            return self._step()
        finally:
            self.ranks.end_step()

    def _step(self) -> list[RequestOutput]:
        t = self._timer = StepTimer(self.draft_clock)  # fills this step's record (runtime/core/step_record.py)
        sched = self.scheduler.schedule()  # 1. schedule
        self._after_schedule(sched)
        t.lap("schedule")
        if not sched.scheduled:
            self._idle_step()
            return self._end_step([])
        scheduled = sched.scheduled
        tables = table_array([self.kv.block_table(s.req.req_id) for s in scheduled], self.width)
        main_plan = plan_main(scheduled, tables)
        prompt_spans = logprobs.add_prompt_rows(scheduled, main_plan)  # echo: prompt logprobs (usually none)
        t.record.num_scheduled, t.record.main_rows = len(scheduled), len(main_plan.inp.input_ids)
        main = t.executor(self.executor.run_main, self._main_input(scheduled, main_plan))  # 2. verify (+ main KV)
        t.lap("verify")
        logprobs.record_prompt(scheduled, prompt_spans, main.logits)
        accepted, next_tokens, errors = accept.accept_all(scheduled, main_plan, main.logits)  # 3. accept
        may_draft = self.k > 0 and any(s.req.spec.may_draft for s in scheduled)  # False: all frozen, plan as K=0
        k, freeze = self._choose_draft_length(lambda: self._sample(scheduled, accepted, errors), may_draft)
        ks: int | list[int] = k  # per-request: k_i each, and k = the draft loop's depths (agreed across ranks)
        if self.verify_lengths is not None and may_draft:
            ks = self.verify_lengths.choose(mtp_plan.verify_candidates(scheduled, accepted, errors, self.cfg.max_seq_len), k)
            freeze = getattr(self.verify_lengths, "gives_up_drafting", False)  # k_i = 0 settled (verify_lengths.py)
        t.lap("accept")
        plan = plan_step(scheduled, main_plan, main.hidden, accepted, next_tokens, errors=errors, mtp=may_draft,
                         draft_depths=ks, refresh_drafts=self.cfg.commit_pass, max_carry_rows=self._max_carry_rows,
                         max_commit_rows=self.cfg.max_num_tokens, freeze=freeze)  # 4. plan  # fmt: skip
        t.lap("plan")
        for commit in plan.commits:  # 5. commit (no collective inside, so skipping an empty write keeps lockstep)
            t.record.commit_rows.append(len(commit.token_ids))
            t.executor(self.executor.run_commit, commit)
        t.lap("commit")
        outputs, drafting = self._apply(scheduled, plan)  # 6. apply
        t.lap("apply")
        if self.k:  # 7. draft
            k_i = [k] * len(drafting) if isinstance(ks, int) else [ks[i] for i in drafting]
            self._draft([scheduled[i].req for i in drafting], [plan.updates[i] for i in drafting], main.hidden,
                        tables[drafting], outputs, k_i, self._agreed_depths(k_i, k))  # fmt: skip
        t.lap("draft")
        self._publish(scheduled)  # 8. publish
        t.lap("publish")
        return self._end_step(outputs)

    def _after_schedule(self, sched: SchedulerOutput) -> None:
        """Preemptions (a hybrid model's preempted request restarts from position 0: a fresh recurrent state), then
        the prefix cache's copy-on-write copies, before anything reads them."""
        self._timer.record.num_preemptions = len(sched.preempted)
        if self.state_slots is not None:
            self.state_slots.free(*[r.req_id for r in sched.preempted])
        if sched.block_copies:
            self.executor.copy_blocks(sched.block_copies)
            self.kv.complete_copies()

    def _idle_step(self) -> None:
        """Nothing scheduled here: a lockstep rank still enters every collective-bearing forward (invariant 9)."""
        if self.ranks.lockstep:
            idle = mtp_plan.plan_idle_main(self.width)
            self.executor.run_main(idle if self.state_slots is None else idle_input(idle))
            self._dummy_drafts(self._agreed_depths([], self._choose_draft_length(StepSample)[0]))

    def _main_input(self, scheduled: list[ScheduledRequest], main_plan: MainPlan):
        """The verify forward's input; a hybrid model's also names each request's recurrent-state slots."""
        return main_plan.inp if self.state_slots is None else self.state_slots.plan(scheduled, main_plan.inp)

    def _end_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Publish the step's record to its readers: auto's cycles, the metrics, `last_step`, the listeners."""
        record = self._timer.finish()
        if record.num_scheduled and self.draft_length is not None:
            self._cycles.close(record)
        self.metrics.record_step(record, self.kv)
        self.last_step = record
        for listener in self.step_listeners:
            listener(record)
        return outputs

    def _sample(self, scheduled: list[ScheduledRequest], accepted: list[int], errors: list[str | None]) -> StepSample:
        """This step's measurements for the draft-length controller (with K=0 chosen it still measures)."""
        if self.draft_length is None:
            return StepSample()
        return mtp_plan.step_sample(scheduled, accepted, errors, self.k, self.cfg.max_seq_len, self._cycles.take())

    def _choose_draft_length(self, measure: Callable[[], StepSample], may_draft: bool = True) -> tuple[int, bool]:
        """Fixed K, or the controller's pick (under MPI from every rank's sample, so every rank picks the same),
        and whether this step's requests stop keeping their MTP plane (`auto` gave up drafting: docs/RUNTIME.md).
        may_draft: some request here may draft (alone and none may: nothing to decide; lockstep ranks still gather)."""
        ctl = self.draft_length
        if ctl is None:
            return self.k, False
        if not (may_draft or self.ranks.lockstep) or ctl.skips_this_step():  # k = 0 settled: no sample (all ranks)
            return 0, False
        sample = measure()
        if self.ranks.lockstep:
            sample = combine(self.ranks.gather_draft_samples(sample.to_array(self.k)), self.k)
        ctl.observe(sample)
        k = ctl.choose(sample.num_drafting, sample.base_rows, sample.remaining)
        return k, ctl.gives_up_drafting

    def _agreed_depths(self, k_i: list[int], k: int) -> int:
        """The draft loop's depths: k, or per-request the deepest k_i (lockstep: over every rank, so each rank issues
        the same number of collective-bearing draft forwards; a rank whose requests stopped earlier pads)."""
        if self.verify_lengths is None:
            return k
        k = max(k_i, default=0)
        return int(max(s[0] for s in self.ranks.gather_draft_samples(np.array([k], float)))) if self.ranks.lockstep else k

    def _apply(self, scheduled: list[ScheduledRequest], plan: StepPlan) -> tuple[list[RequestOutput], list[int]]:
        """Apply the plan to request state and emit. Returns the outputs and the indices (into scheduled)
        of the requests that draft next."""
        outputs, drafting = [], []
        for i, (s, upd) in enumerate(zip(scheduled, plan.updates, strict=True)):
            req = s.req
            if upd.error is not None:
                outputs.append(self._fail(req, upd.error))
                continue
            req.num_computed = upd.num_computed
            req.spec.carry, req.spec.drafts, req.spec.draft_probs = upd.carry, [], None
            req.spec.mtp_frozen_at = req.spec.mtp_frozen_at if upd.mtp_frozen_at is None else upd.mtp_frozen_at
            if not upd.emit:  # a non-final prefill chunk
                continue
            self._record_verify(s, upd.num_accepted)
            try:
                new = self._emit(req, upd.emit)
            except Exception as e:  # noqa: BLE001 - e.g. the tokenizer failing on this request's stop strings
                outputs.append(self._fail(req, f"emission failed: {type(e).__name__}: {e}"))
                continue
            outputs.append(RequestOutput.snapshot(req, new))
            if not req.is_finished and req.spec.may_draft:  # drafts next (k = 0 included: counted, not run)
                drafting.append(i)
        if self.state_slots is not None:  # rollback of the recurrent state: a slot choice per request
            self.state_slots.commit(scheduled, plan.updates)
        return outputs, drafting

    def _publish(self, scheduled: list[ScheduledRequest]) -> None:
        """Publish blocks whose main and MTP entries are final (a prefix hit drafts from the MTP entries)."""
        for s in scheduled:
            if not s.req.is_finished:
                final = s.req.spec.mtp_exact_end(s.req.num_computed)
                main = None if s.req.spec.may_draft else s.req.num_computed  # frozen: its later blocks main-only
                if self.kv.publish_full_blocks(s.req.req_id, s.req.token_ids, final, main) and self.state_slots:
                    self.state_slots.published(s.req.req_id)  # its snapshots of those blocks become cached

    def _dummy_drafts(self, k: int) -> None:
        """An idle lockstep rank's k draft depths (one padded row on the null block)."""
        for _ in range(k):
            self.executor.run_draft(mtp_plan.plan_idle_draft(self.executor.hidden_size, self.width))

    def _draft(self, reqs: list[Request], updates: list[RequestUpdate], main_hidden: np.ndarray, tables: np.ndarray,
               outputs: list[RequestOutput], k_i: list[int], k: int) -> None:  # fmt: skip
        """k serial depths (runtime/core/draft_loop.py) for the requests that draft (an idle lockstep rank pads);
        a request failing there is aborted after the loop."""
        record = self._timer.record
        record.draft_depths, record.num_drafting = k, len(reqs)
        record.k_per_request = {r.req_id: n for r, n in zip(reqs, k_i, strict=True)}
        if not (reqs and k):
            if self.ranks.lockstep:
                self._dummy_drafts(k)
            return

        def run_draft(inp):
            record.draft_rows.append(int(inp.counts.sum()))
            return self._timer.executor(self.executor.run_draft, inp)

        def padded_depth() -> None:
            record.draft_rows.append(0)
            self._dummy_drafts(1)

        def run_fused(inp):
            record.draft_rows.extend([len(reqs)] * k)  # every row runs every depth
            return self._timer.executor(self._run_fused, inp)

        fused = run_fused if k == self._fused_k else None
        failed = draft_loop.run(run_draft, padded_depth, reqs, updates, main_hidden, tables, k_i, k, fused)
        outputs += [self._fail(reqs[j], error) for j, error in failed.items()]

    # ------------------------------------------------------------------ emission and bookkeeping
    def _emit(self, req: Request, tokens: list[int]) -> list[int]:
        p = req.params
        if p.max_tokens == 0:  # a scoring request (echo, max_tokens 0): its prompt's logprobs were the point
            self._finish(req, "length")
            logprobs.commit(req, 0)
            return []
        stop_ids = {p.end_id} if p.end_id is not None else set(self.model_cfg.eos_token_id)
        new = []
        for t in tokens:
            req.token_ids.append(t)
            new.append(t)
            self._timer.record.num_generated_tokens += 1
            if self.tokenizer is not None and p.stop:  # stop strings are checked token by token
                req.text = self.tokenizer.decode(req.output_ids)
            if t in stop_ids:
                self._finish(req, "stop")
            elif p.stop and any(s in req.text for s in p.stop):
                cut = min(req.text.find(s) for s in p.stop if s in req.text)
                req.text = req.text[:cut]
                self._finish(req, "stop")
            elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.cfg.max_seq_len:
                self._finish(req, "length")
            if req.is_finished:
                break
        if self.tokenizer is not None and not p.stop:
            req.text = self.tokenizer.decode(req.output_ids)  # once per step, not once per emitted token
        logprobs.commit(req, len(new))
        return new

    def _finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.scheduler.finish(req)
        if self.state_slots is not None:
            self.state_slots.free(req.req_id)
        self.requests.pop(req.req_id, None)  # a finished request lives on only in its last output

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """Abort one request for a failure of its own; its final output carries the error."""
        req.error = error
        if not req.is_finished:
            self._finish(req, "error")
        return RequestOutput.snapshot(req, [])

    def _record_verify(self, s: ScheduledRequest, a: int) -> None:
        """A decode verify step: drafts were verified, or (no drafts) one base token after an output."""
        if s.num_drafts > 0 or (s.num_new_tokens == 1 and s.req.num_output_tokens > 0):
            s.req.num_steps += 1
            s.req.num_proposed += s.num_drafts
            s.req.accepted_per_step.append(a)
            self._timer.record.proposed_per_request[s.req.req_id] = s.num_drafts
            self._timer.record.accepted_per_request[s.req.req_id] = a
            self.acceptance_watch.feed(s.num_drafts, a)

    # ------------------------------------------------------------------ convenience
    def stream(self) -> Iterator[RequestOutput]:
        """Step until no request is left (in a lockstep job: until no DP group has one; every rank steps alike)."""
        while self.ranks.any_busy(self.has_unfinished()):
            yield from self.step()

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns the final output of each, in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        final = {out.req_id: out for out in self.stream() if out.finished}
        return [final[i] for i in ids]
