"""Per-request state, split by concern: tokens and progress (`Request`), speculative state (`SpecState`),
and the random generator each request samples with.

Token-count view (vLLM style): `token_ids` is one append-only list, prompt first, then every emitted
token; positions `0..num_computed-1` hold committed main KV. Each step a request forwards
`token_ids[num_computed:]` (capped by the chunk budget) plus its drafts when the chunk reaches the end.
When the last token of `token_ids` is the un-forwarded *base* token, that is a decode step; otherwise a
prefill chunk. The draft start is never stored: it is derived from `num_computed` (invariant 3).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.core.sampling import SamplingParams
from runtime.core.verify_lengths import AcceptanceCounts


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2  # ordering matters: >= FINISHED means done


@dataclass(slots=True)
class ChunkCarry:
    """Main hiddens whose MTP entries are not written yet (invariant 7): positions position..end-1.

    A non-final prefill chunk carries its last row (the next chunk's seam row); with `auto` at k = 0 a
    decode step carries h_{base-1} too, until a step writes them all. The next forward starts at `end`.
    """

    position: int  # first carried position p
    hidden: np.ndarray  # float32 [m, H] main hiddens h_p .. h_{end-1}

    @property
    def end(self) -> int:
        return self.position + len(self.hidden)


@dataclass(slots=True)
class SpecState:
    """What the speculative step carries from one step to the next; KV-derived, so preemption drops it."""

    drafts: list[int] = field(default_factory=list)  # d_0..d_{k-1} proposed last step, verified this step
    draft_probs: np.ndarray | None = None  # float32 [k, V] (rejection sampling only)
    carry: ChunkCarry | None = None  # set between the chunks of a chunked prefill, never with drafts
    # `auto` or the per-request policy settled on k = 0: the request stopped keeping its MTP plane (no carry, no
    # commit) and never drafts again, or was admitted without it (the per-request policy, already settled: then
    # its first forwarded position); its MTP entries are exact below this position only (None: it may draft)
    mtp_frozen_at: int | None = None

    @property
    def may_draft(self) -> bool:
        return self.mtp_frozen_at is None

    def mtp_exact_end(self, num_computed: int) -> int:
        """Positions below this hold final MTP entries: not a carried one (written later), nor one at or past a
        frozen plane's first unwritten position (never written). Prefix blocks publish only below it."""
        end = num_computed if self.carry is None else self.carry.position
        return end if self.mtp_frozen_at is None else min(end, self.mtp_frozen_at)


def request_rng(engine_seed: int, req_id: str, seed: int | None) -> np.random.Generator:
    """The request's own generator: from its explicit seed, else from (engine seed, request id).

    Per request rather than one engine generator, so a request's samples never depend on which other
    requests share its batches (or its rank). blake2b, not hash(): str hashes differ between processes.
    """
    if seed is not None:
        return np.random.default_rng(seed)
    digest = int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([engine_seed, digest])


@dataclass(slots=True)
class Request:
    req_id: str
    token_ids: list[int]  # append-only: the prompt, then every emitted token
    params: SamplingParams
    arrival: int  # admission order (preemption picks the newest)
    rng: np.random.Generator
    num_prompt_tokens: int = -1  # set from token_ids on creation
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # committed main-KV positions
    spec: SpecState = field(default_factory=SpecState)
    finish_reason: str | None = None
    error: str | None = None  # why the engine aborted the request (finish_reason "error")
    # stats
    num_steps: int = 0  # verify steps that emitted tokens
    num_proposed: int = 0  # drafts verified over all steps (k may change per step)
    accepted_per_step: list[int] = field(default_factory=list)  # append-only
    verify_counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)  # per-request k's running acceptance
    num_cached_tokens: int = 0  # prefix-cache hit tokens at admission
    text: str = ""
    # asked-for extras (runtime/core/logprobs.py, runtime/core/grammar.py); empty / None when not asked for
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token (append-only)
    staged_logprobs: list = field(default_factory=list)  # this step's, until emission keeps the emitted ones
    prompt_logprobs: list = field(default_factory=list)  # None, then TokenLogprob per prompt token 1..P-1
    matcher: Any = None  # the grammar matcher, at the state after every emitted token

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)  # owned: the caller's list is never appended to
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        """A copy of the generated ids (O(output)); per-step code uses num_output_tokens instead."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption: drop KV-derived state; the request is re-prefilled from its tokens later."""
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.spec = SpecState()


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request: a delta plus O(1) snapshots of the append-only state.

    `output_ids` / `accepted_per_step` slice the request's lists at this step's lengths on access, so a
    step never copies a full output, and an output kept from an earlier step still reads as of that step.
    """

    req_id: str
    new_token_ids: list[int]  # emitted this step (stream these)
    text: str  # detokenized output so far ("" without a tokenizer)
    finished: bool
    finish_reason: str | None
    num_steps: int
    num_output_tokens: int
    num_proposed: int = 0  # drafts verified so far (acceptance rate = sum(accepted_per_step) / this)
    error: str | None = None  # set when the engine aborted the request (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set when first scheduled)
    _tokens: list[int] = field(default_factory=list, repr=False)
    _num_prompt_tokens: int = 0
    _accepted: list[int] = field(default_factory=list, repr=False)
    _logprobs: list = field(default_factory=list, repr=False)
    prompt_logprobs: list = field(default_factory=list, repr=False)  # the request's list (filled by prefill)

    @classmethod
    def snapshot(cls, req: Request, new_token_ids: list[int]) -> RequestOutput:
        return cls(req.req_id, new_token_ids, req.text, req.is_finished, req.finish_reason, req.num_steps,
                   req.num_output_tokens, req.num_proposed, req.error, req.num_cached_tokens, req.token_ids,
                   req.num_prompt_tokens, req.accepted_per_step, req.logprobs, req.prompt_logprobs)  # fmt: skip

    @property
    def output_ids(self) -> list[int]:
        """All generated ids up to this step."""
        return self._tokens[self._num_prompt_tokens : self._num_prompt_tokens + self.num_output_tokens]

    @property
    def accepted_per_step(self) -> list[int]:
        """Accepted drafts of every verify step up to this one."""
        return self._accepted[: self.num_steps]

    @property
    def logprobs(self) -> list:
        """TokenLogprob of every generated token up to this step (empty unless the request asked)."""
        return self._logprobs[: self.num_output_tokens]
