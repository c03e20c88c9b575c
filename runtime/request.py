"""Per-request state: tokens, how many are committed, drafts in flight, the chunk carry, stats.

Token-count view (vLLM style): `token_ids` = prompt + emitted outputs; positions
`0..num_computed-1` hold committed main KV. Each step a request forwards `token_ids[num_computed:]`
(capped by the chunk budget) plus its drafts when the chunk reaches the end. When the last token of
`token_ids` is the un-forwarded *base* token, that is a decode step; otherwise a prefill chunk. The
draft start is never stored: it is derived from `num_computed` (invariant 3).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from runtime.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2  # ordering matters: >= FINISHED means done


@dataclass(slots=True)
class ChunkCarry:
    """The last hidden of a non-final prefill chunk, consumed by the next chunk's seam row (invariant 7)."""

    position: int  # position p of the hidden; the next chunk must start at p + 1
    hidden: np.ndarray  # float32 [H] main hidden h_p


@dataclass(slots=True)
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order (preemption picks the newest)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # committed main-KV positions
    drafts: list[int] = field(default_factory=list)  # d_0..d_{k-1} proposed last step, verified this step
    draft_probs: np.ndarray | None = None  # float32 [k, V] (rejection sampling only)
    carry: ChunkCarry | None = None
    finish_reason: str | None = None
    rng: np.random.Generator = field(default_factory=np.random.default_rng)  # set from params.seed by the engine
    # stats
    num_steps: int = 0  # verify steps that emitted tokens
    accepted_per_step: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit tokens at admission
    text: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption: drop KV-derived state; the request is re-prefilled from its tokens later."""
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.drafts = []
        self.draft_probs = None
        self.carry = None
