"""Sampling parameters, logits -> probabilities, token sampling and MTP draft acceptance (numpy only).

Owns the per-request sampling policy and the pure acceptance rules of docs/ARCHITECTURE.md §4 (phase 3, accept).
It must not import torch or know about blocks or ranks: executors hand it host arrays, and the caller
makes every sampling decision once (rank 0, or identical seeds) and broadcasts it (invariant 9).

Row convention for one decode request with k drafts (verify forward over `b, d_0 .. d_{k-1}`)::

    row i of target_*  : main model's prediction for the token after d_{i-1} (row 0: after base b)
    draft_ids[i]       : d_i, proposed for the same position as row i
    row k              : bonus row, used only when all k drafts are accepted

All three acceptance rules return `(num_accepted, next_token)`: the request emits
`draft_ids[:num_accepted] + [next_token]`, and `next_token` becomes the new base token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

AcceptanceMethod = Literal["exact", "rejection"]
ACCEPTANCE_METHODS: tuple[str, ...] = ("exact", "rejection")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling policy. temperature == 0 means greedy (argmax), whatever the other fields say."""

    temperature: float = 0.0  # softmax temperature; 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set of tokens whose mass reaches top_p; 1 = off
    seed: int | None = None  # per-request np.random.Generator seed; None = engine generator
    max_tokens: int = 16  # output tokens to generate at most; 0 with prompt_logprobs: score the prompt only
    stop: tuple[str, ...] = ()  # stop strings, matched by the runtime on detokenized output
    end_id: int | None = None  # end-of-sequence token id; None = never stop on a token
    acceptance: AcceptanceMethod = "exact"  # sampled-mode draft acceptance: "exact" match or "rejection"
    logprobs: int | None = None  # per output token: its logprob and this many top alternatives; None = off
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (OpenAI echo)
    grammar: Any = None  # a runtime.core.grammar.Grammar: output constrained to it (structured output); None = free

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field and how to fix it.

        The one admission check of a request's policy: everything downstream (probs_from_logits, the
        acceptance rules, np.random.default_rng) assumes these types and ranges, so a value that slipped
        through would fail later inside engine.step() for the whole batch, not just this request.
        """
        t, k, p = self.temperature, self.top_k, self.top_p
        if not is_real(t) or not _finite(t) or t < 0.0:
            raise ValueError(f"temperature={t!r}: must be a finite number >= 0 (use 0 for greedy decoding)")
        if not is_int(k) or k < 0:
            raise ValueError(f"top_k={k!r}: must be an int >= 0 (use 0 to disable top-k filtering)")
        if not is_real(p) or not 0.0 < p <= 1.0:  # NaN and inf fail the range
            raise ValueError(f"top_p={p!r}: must be a number in (0, 1] (use 1.0 to disable nucleus filtering)")
        if not is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an int >= 1 (output tokens to generate), or 0 "
                             "with prompt_logprobs (score the prompt, generate nothing)")  # fmt: skip
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed={self.seed!r}: must be an int in [0, 2**64) or None")
        if self.end_id is not None and (not is_int(self.end_id) or not 0 <= self.end_id < vocab_size):
            raise ValueError(f"end_id={self.end_id!r}: must be a token id (int) in [0, {vocab_size}) or None")
        if not isinstance(self.acceptance, str) or self.acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance={self.acceptance!r}: unknown method, use one of {ACCEPTANCE_METHODS}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name}={n!r}: must be an int in [0, {MAX_TOP_LOGPROBS}] (top alternatives) or None")
        if self.grammar is not None and not callable(getattr(self.grammar, "new_matcher", None)):
            raise ValueError(f"grammar={self.grammar!r}: must be a runtime.core.grammar.Grammar or None")
        if not isinstance(self.stop, tuple | list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: must be a tuple of non-empty strings, e.g. ('\\n\\n',)")


MAX_TOP_LOGPROBS = 20  # top alternatives per token at most (OpenAI chat's and vLLM's bound)
SEED_LIMIT = 2**64  # seeds cross the Triton API as uint64; default_rng takes any int >= 0


def is_int(x: object) -> bool:
    """A Python or numpy integer; bool is not (True would silently mean 1)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A Python or numpy int/float; bool, str, complex and None are not."""
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))  # NaN and inf are not
    except OverflowError:  # an int beyond float range
        return False


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Apply temperature, top-k and top-p to logits [N, V] and return probabilities [N, V] (float64).

    Greedy (temperature == 0) returns one-hot rows at the argmax (first index on ties), so `sample`
    and the acceptance rules need no greedy special case. Top-k keeps ties with the k-th logit.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got shape {logits.shape}")
    num_rows, vocab_size = logits.shape
    if params.is_greedy:
        probs = np.zeros_like(logits)
        probs[np.arange(num_rows), logits.argmax(axis=1)] = 1.0
        return probs
    # Subtract the row max before dividing: logits / 1e-310 overflows to inf and inf - inf is NaN, while
    # (logits - max) / T is <= 0 and at worst -inf, so exp() stays finite for every temperature > 0.
    with np.errstate(over="ignore"):  # overflow to -inf is the intended result: exp(-inf) = 0
        scaled = (logits - logits.max(axis=1, keepdims=True)) / params.temperature
    if 0 < params.top_k < vocab_size:
        kth = np.partition(scaled, vocab_size - params.top_k, axis=1)[:, vocab_size - params.top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(axis=1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=1, kind="stable")  # [N, V] most likely first
        sorted_probs = np.take_along_axis(probs, order, axis=1)
        mass_before = np.cumsum(sorted_probs, axis=1) - sorted_probs  # mass of strictly more likely tokens
        keep_sorted = mass_before < params.top_p  # the most likely token is always kept
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draw one token id per row of probs [N, V] by inverse CDF; returns int64 [N]. Zero-mass ids never come out."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs, axis=1)  # [N, V]
    u = (1.0 - rng.random(probs.shape[0])) * cdf[:, -1]  # in (0, total]: u == 0 could pick a zero-mass id 0
    ids = (cdf < u[:, None]).sum(axis=1)
    return np.minimum(ids, probs.shape[1] - 1).astype(np.int64)


def _accept_prefix(draft_ids: Sequence[int], target_ids: Sequence[int], what: str) -> tuple[int, int]:
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{what} needs k+1 = {len(draft_ids) + 1} rows for k={len(draft_ids)} drafts, "
                         f"got {len(target_ids)}")
    num_accepted = 0
    while num_accepted < len(draft_ids) and int(draft_ids[num_accepted]) == int(target_ids[num_accepted]):
        num_accepted += 1
    return num_accepted, int(target_ids[num_accepted])


def accept_greedy(draft_ids: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Greedy acceptance: the longest prefix of drafts equal to the main argmax, then the argmax after it.

    Args:
        draft_ids: d_0..d_{k-1}.
        target_argmax: main-model argmax of rows 0..k (k+1 entries).
    Returns:
        (num_accepted, next_token) with next_token = target_argmax[num_accepted].
    """
    return _accept_prefix(draft_ids, target_argmax, "target_argmax")


def accept_exact_match(draft_ids: Sequence[int], target_samples: Sequence[int]) -> tuple[int, int]:
    """Sampled acceptance by exact match against the main model's own sample of every row (lossless).

    Row i's sample is only used when d_0..d_{i-1} were accepted, i.e. when the row's context is the one
    the main model would have sampled from anyway, so the output distribution is the main model's.
    """
    return _accept_prefix(draft_ids, target_samples, "target_samples")


def accept_rejection(draft_ids: Sequence[int], draft_probs: np.ndarray, target_probs: np.ndarray,
                     rng: np.random.Generator) -> tuple[int, int]:
    """Leviathan-style speculative sampling: lossless and accepts at least as often as exact match.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a sample of
    normalize(max(p_i - q_i, 0)); when all k drafts pass, emit a bonus sample of p_k.

    NOTE: lossless only if each d_i was itself sampled from draft_probs[i] (the MTP head's distribution
    after the same sampling transforms). Greedy drafts with sampled targets need `accept_exact_match`.

    Args:
        draft_ids: d_0..d_{k-1}.
        draft_probs: [k, V] q_i, the distributions the drafts were sampled from.
        target_probs: [k+1, V] p_i, the main model's distributions (after `probs_from_logits`).
        rng: the request's generator.
    Returns:
        (num_accepted, next_token).
    """
    k = len(draft_ids)
    draft_probs, target_probs = np.asarray(draft_probs), np.asarray(target_probs)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1 or draft_probs.shape[1:] != target_probs.shape[1:]:
        raise ValueError(f"for k={k} drafts expected draft_probs [k, V] and target_probs [k+1, V], got "
                         f"{draft_probs.shape} and {target_probs.shape}")
    for i, d in enumerate(draft_ids):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if rng.random() * q < p:  # u < p/q without dividing; q == 0 accepts iff p > 0
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        if residual.sum() <= 0.0:  # p == q: a rejection has probability 0, reachable only via rounding
            residual = target_probs[i]
        return i, int(sample(residual[None, :], rng)[0])
    return k, int(sample(target_probs[k][None, :], rng)[0])


def draft_token(params: SamplingParams, rng: np.random.Generator, logits: np.ndarray, probs: list[np.ndarray]) -> int:
    """One draft from a depth's (grammar-masked) logits [1, V]: sampled when rejection acceptance will check it
    against its distribution (appended to probs), else the argmax."""
    if params.acceptance == "rejection" and not params.is_greedy:
        q = probs_from_logits(logits, params)
        probs.append(q[0])
        return int(sample(q, rng)[0])
    return int(logits[0].argmax())
