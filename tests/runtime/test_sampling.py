"""Sampling: parameter validation, logits -> probs filters, and the three MTP acceptance rules (CPU only)."""

import numpy as np
import pytest

from runtime.core.sampling import (
    SamplingParams,
    accept_exact_match,
    accept_greedy,
    accept_rejection,
    probs_from_logits,
    sample,
)

# chi-square critical values at p = 0.001 by degrees of freedom (scipy is not installed)
CHI2_CRIT_001 = {3: 16.266, 5: 20.515}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson statistic; categories with zero expected mass must have zero counts (else inf)."""
    expected = counts.sum() * probs
    if np.any(counts[expected == 0] > 0):
        return float("inf")
    mask = expected > 0
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


# ---------------------------------------------------------------------------------------------- params
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -3}, "seed"),
        ({"end_id": 10}, "end_id"),
        ({"acceptance": "typical"}, "acceptance"),
        ({"stop": "\n"}, "stop"),
    ],
)
def test_validate_names_the_field_and_the_fix(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.*(use|must)"):
        SamplingParams(**kwargs).validate(vocab_size=10)


def test_defaults_are_valid_and_greedy():
    params = SamplingParams()
    params.validate(vocab_size=10)
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1, end_id=9, acceptance="rejection",
                   stop=("\n\n",)).validate(10)
    assert params.is_greedy and not SamplingParams(temperature=1.0).is_greedy


# ---------------------------------------------------------------------------------------------- probs
LOGITS = np.array([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_greedy_is_one_hot_argmax():
    probs = probs_from_logits(LOGITS, SamplingParams(top_k=2, top_p=0.1))
    assert probs.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert probs_from_logits(np.zeros((1, 3)), SamplingParams())[0].tolist() == [1, 0, 0]  # ties: first id


def test_temperature_scales_logits():
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(probs, softmax(LOGITS / 0.5))


def test_top_k_keeps_k_most_likely():
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert np.flatnonzero(probs[0]).tolist() == [0, 4]
    np.testing.assert_allclose(probs[0, [0, 4]], softmax(np.array([2.0, 3.0])))
    assert np.count_nonzero(probs[1]) == 6  # ties with the k-th logit are kept


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    # no p sits exactly on a cumulative mass (0.5, 0.8): whether exp(log(.)) lands a hair above or below it is the
    # CPU's rounding (an AVX2 machine kept a third token at p=0.8 where AVX-512 ones kept two)
    keep = {p: np.flatnonzero(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=p))[0]).tolist()
            for p in (0.4, 0.49, 0.51, 0.79, 0.81, 1.0)}
    assert keep == {0.4: [0], 0.49: [0], 0.51: [0, 1], 0.79: [0, 1], 0.81: [0, 1, 2], 1.0: [0, 1, 2, 3]}
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.79))
    np.testing.assert_allclose(probs[0], [0.625, 0.375, 0, 0])


def test_sample_follows_probs_and_never_picks_zero_mass():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 0.1, 0.2, 0.0, 0.3, 0.4])
    draws = sample(np.tile(probs, (40_000, 1)), rng)
    counts = np.bincount(draws, minlength=6)
    assert counts[0] == counts[3] == 0
    assert chi_square(counts, probs) < CHI2_CRIT_001[3]
    assert sample(np.array([[0.0, 1.0], [1.0, 0.0]]), rng).tolist() == [1, 0]


# ---------------------------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize(
    ("draft_ids", "target_ids", "expected"),
    [
        pytest.param([5, 6, 7], [5, 6, 7, 8], (3, 8), id="perfect match: bonus token"),
        pytest.param([5, 6, 7], [1, 6, 7, 8], (0, 1), id="early mismatch"),
        pytest.param([5, 6, 7], [5, 1, 7, 8], (1, 1), id="mismatch in the middle"),
        pytest.param([5, 6, 7], [5, 6, 1, 8], (2, 1), id="mismatch at last"),
        pytest.param([], [4], (0, 4), id="empty drafts"),
        pytest.param([5, 6], [5, 9, 6], (1, 9), id="later rows ignored after a mismatch"),
    ],
)
def test_accept_greedy_and_exact_match_table(draft_ids, target_ids, expected):
    assert accept_greedy(draft_ids, target_ids) == expected
    assert accept_exact_match(draft_ids, np.array(target_ids)) == expected


def test_accept_checks_row_count():
    with pytest.raises(ValueError, match="k\\+1 = 3 rows"):
        accept_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError, match="target_probs"):
        accept_rejection([1], np.ones((1, 4)) / 4, np.ones((1, 4)) / 4, np.random.default_rng(0))


def test_rejection_with_one_hot_probs_is_greedy():
    rng = np.random.default_rng(0)
    eye = np.eye(10)
    for draft_ids, target_ids, expected in [([5, 6, 7], [5, 6, 7, 8], (3, 8)), ([5, 6, 7], [5, 6, 1, 8], (2, 1))]:
        assert accept_rejection(draft_ids, eye[draft_ids], eye[target_ids], rng) == expected


TARGET = np.array([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05], [0.30, 0.05, 0.05, 0.20, 0.10, 0.30],
                   [0.10, 0.10, 0.50, 0.10, 0.10, 0.10]])
DRAFT = np.array([[0.40, 0.05, 0.30, 0.05, 0.00, 0.20], [0.10, 0.60, 0.10, 0.10, 0.05, 0.05]])


def run_speculation(num_trials: int, accept) -> tuple[np.ndarray, np.ndarray, float]:
    """Drafts sampled from DRAFT; returns counts of the 1st emitted token, of the 2nd when emitted, acceptance."""
    rng = np.random.default_rng(1234)
    first, second, accepted = np.zeros(6, int), np.zeros(6, int), 0
    for _ in range(num_trials):
        drafts = [int(sample(DRAFT[i:i + 1], rng)[0]) for i in range(2)]
        num_accepted, next_token = accept(drafts, rng)
        emitted = drafts[:num_accepted] + [next_token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        accepted += num_accepted
    return first, second, accepted / num_trials


def test_rejection_sampling_is_lossless():
    """The emitted tokens follow the target rows although the drafts come from an unrelated DRAFT."""
    first, second, mean_accepted = run_speculation(
        20_000, lambda drafts, rng: accept_rejection(drafts, DRAFT, TARGET, rng))
    assert chi_square(first, TARGET[0]) < CHI2_CRIT_001[5]
    assert chi_square(second, TARGET[1]) < CHI2_CRIT_001[5]  # given d_0 accepted, token 2 follows row 1
    # E[accepted] = sum(min(p0, q0)) * (1 + sum(min(p1, q1))) = 0.30 * 1.4 = 0.42
    assert abs(mean_accepted - 0.42) < 0.03


def test_chi_square_detects_a_lossy_rule():
    """Accepting every draft (the bug this guards against) emits DRAFT's distribution and must be caught."""
    first, _, _ = run_speculation(5_000, lambda drafts, rng: (len(drafts), int(sample(TARGET[2:], rng)[0])))
    assert chi_square(first, TARGET[0]) > CHI2_CRIT_001[5]


def test_exact_match_with_sampled_targets_is_lossless():
    def accept(drafts, rng):
        return accept_exact_match(drafts, sample(TARGET, rng).tolist())

    first, second, mean_accepted = run_speculation(20_000, accept)
    assert chi_square(first, TARGET[0]) < CHI2_CRIT_001[5]
    assert chi_square(second, TARGET[1]) < CHI2_CRIT_001[5]
    assert abs(mean_accepted - 0.102) < 0.02  # sum(p0*q0) * (1 + sum(p1*q1)): well below rejection's 0.42


@pytest.mark.parametrize("temperature", [1e-310, 5e-324])
def test_subnormal_temperature_gives_finite_one_hot_probs(temperature):
    """logits / T overflowed to inf and inf - inf gave NaN rows; scaling after the max shift cannot."""
    probs = probs_from_logits(LOGITS[:1], SamplingParams(temperature=temperature, top_p=0.9))
    assert np.isfinite(probs).all() and probs[0].argmax() == 4 and probs[0, 4] == 1.0
