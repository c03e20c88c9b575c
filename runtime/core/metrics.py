"""Run metrics (docs/ARCHITECTURE.md): acceptance by draft position, tokens/s, executor vs host time, KV use.

Counters summed over the engine's step records (`record_step`); nothing here times anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.core.step_record import StepRecord


@dataclass(slots=True)
class Metrics:
    num_draft_tokens: int
    proposed_per_position: list[int] = field(default_factory=list)  # verify steps that proposed position i
    accepted_per_position: list[int] = field(default_factory=list)  # ... and accepted it
    reached_per_position: list[int] = field(default_factory=list)  # ... proposed it with 0..i-1 accepted
    num_verify_steps: int = 0  # decode verify steps over all requests (one per request per step)
    num_emitted_tokens: int = 0  # tokens emitted by decode verify steps (bonus included)
    num_generated_tokens: int = 0  # all output tokens (incl. the first token after prefill)
    num_steps: int = 0
    executor_seconds: float = 0.0
    step_seconds: float = 0.0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    kv_blocks_used: int = 0  # at the last step
    kv_blocks_free: int = 0
    kv_blocks_used_peak: int = 0
    draft_length_counts: list[int] = field(default_factory=list)  # steps that drafted, by draft length 0..K

    def __post_init__(self) -> None:
        self.proposed_per_position = [0] * self.num_draft_tokens
        self.accepted_per_position = [0] * self.num_draft_tokens
        self.reached_per_position = [0] * self.num_draft_tokens
        self.draft_length_counts = [0] * (self.num_draft_tokens + 1)

    def merge(self, other: Metrics) -> None:
        """Add another rank's counts (times: the slowest rank's, since ranks step in lockstep)."""
        for i in range(self.num_draft_tokens):
            self.proposed_per_position[i] += other.proposed_per_position[i]
            self.accepted_per_position[i] += other.accepted_per_position[i]
            self.reached_per_position[i] += other.reached_per_position[i]
        for name in ("num_verify_steps", "num_emitted_tokens", "num_generated_tokens", "prefix_hit_tokens",
                     "num_preemptions", "kv_blocks_used", "kv_blocks_used_peak", "kv_blocks_free"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("num_steps", "executor_seconds", "step_seconds"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        # the draft length is decided identically on every rank (lockstep), so ranks agree step by step
        self.draft_length_counts = [max(a, b) for a, b in zip(self.draft_length_counts, other.draft_length_counts,
                                                               strict=True)]  # fmt: skip

    def record_verify(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        self.num_verify_steps += 1
        self.num_emitted_tokens += num_emitted
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)
            self.reached_per_position[i] += int(i <= num_accepted)

    def record_step(self, record: StepRecord, kv) -> None:
        """One engine step ended (runtime/core/step_record.py): its counts and times, and the KV cache's state
        after it (kv: the KVCacheManager). An idle step (nothing scheduled) counts only its preemptions."""
        self.num_preemptions += record.num_preemptions
        if not record.num_scheduled:
            return
        self.num_steps += 1
        self.step_seconds += record.total_seconds
        self.executor_seconds += record.executor_seconds
        self.num_generated_tokens += record.num_generated_tokens
        for req_id, accepted in record.accepted_per_request.items():
            self.record_verify(record.proposed_per_request[req_id], accepted, accepted + 1)
        if record.num_drafting and self.num_draft_tokens:  # steps that drafted, by their draft length
            self.draft_length_counts[record.draft_depths] += 1
        self.prefix_hit_tokens = kv.stats.num_hit_tokens
        self.kv_blocks_used, self.kv_blocks_free = kv.num_used_blocks, kv.num_free_blocks
        self.kv_blocks_used_peak = max(self.kv_blocks_used_peak, self.kv_blocks_used)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step, bonus token included (1.0 = no draft ever accepted)."""
        return self.num_emitted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Unconditional: accepted at position i / proposed at position i."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)]

    @property
    def conditional_acceptance_per_position(self) -> list[float]:
        """P(accept i | accepted 0..i-1) = accepted[i] / reached[i]; with a fixed k, reached[i] is accepted[i-1]
        (position 0: proposed), but a step of `auto` that proposed fewer drafts never reached the deeper ones."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position, strict=True)]

    @property
    def host_fraction(self) -> float:
        return 1.0 - self.executor_seconds / self.step_seconds if self.step_seconds else 0.0

    def summary(self, wall_seconds: float, num_requests: int) -> dict:
        return {
            "num_requests": num_requests,
            "num_generated_tokens": self.num_generated_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate_per_position": [round(x, 4) for x in self.acceptance_rate_per_position],
            "conditional_acceptance_per_position": [round(x, 4) for x in self.conditional_acceptance_per_position],
            "tokens_per_second": round(self.num_generated_tokens / wall_seconds, 2) if wall_seconds else 0.0,
            "num_steps": self.num_steps,
            "step_time_ms": round(1000 * self.step_seconds / max(self.num_steps, 1), 3),
            "executor_time_ms": round(1000 * self.executor_seconds / max(self.num_steps, 1), 3),
            "host_fraction": round(self.host_fraction, 4),
            "prefix_cache_hit_tokens": self.prefix_hit_tokens,
            "num_preemptions": self.num_preemptions,
            "kv_blocks_used": self.kv_blocks_used,
            "kv_blocks_used_peak": self.kv_blocks_used_peak,
            "kv_blocks_free": self.kv_blocks_free,
            # how many steps drafted k tokens (with --num-draft-tokens auto, the controller's choices)
            "draft_length_histogram": {str(k): n for k, n in enumerate(self.draft_length_counts) if n},
        }
