"""Sampling is lossless end to end: with temperature > 0 and MTP drafting, the emitted tokens follow the
main model's distribution, for both acceptance rules (chi-square over many seeded requests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.layers import PagedKV, StepMeta
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from runtime.core.kv_manager import cdiv
from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import cached_model, make_engine

PROMPT = [5, 17, 33, 2, 60, 11]
N = 600


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    expected = probs * n
    big = expected >= 5  # merge rare bins into one
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def main_probs(prefix_batch: list[list[int]], temperature: float) -> np.ndarray:
    """Next-token distributions of the main model after each prefix (a direct torch forward)."""
    cfg, model = cached_model()
    geom = KVPoolGeometry(model.num_kv_planes, 8 * len(prefix_batch) + 1, 4, cfg.num_key_value_heads, cfg.head_dim)
    pool = allocate_pool(geom)
    kv = PagedKV(pool_address(pool), geom)
    n = len(prefix_batch[0])
    per = cdiv(n, 4)
    tables = torch.arange(1, 1 + per * len(prefix_batch), dtype=torch.int32).view(len(prefix_batch), per)
    counts = torch.full((len(prefix_batch),), n, dtype=torch.int32)
    meta = StepMeta(torch.arange(n).repeat(len(prefix_batch)), counts, counts, tables)
    with torch.no_grad():
        hidden = model.forward_main(torch.tensor(sum(prefix_batch, [])), meta, kv)
        logits = model.compute_logits(hidden.view(len(prefix_batch), n, -1)[:, -1])
    return torch.softmax(logits / temperature, -1).double().numpy()


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
def test_second_token_follows_main_model(acceptance):
    """Token 2 is emitted by a verify step (its draft came from the MTP head); its marginal must equal
    sum_t1 p(t1 | prompt) p(t2 | prompt, t1) computed from the main model alone."""
    temperature = 1.0
    cfg, _ = cached_model()
    engine = make_engine(2, max_batch=32, max_num_tokens=256, num_blocks=400, enable_prefix_caching=False)
    for seed in range(N):
        engine.add_request(PROMPT, SamplingParams(temperature=temperature, seed=seed, max_tokens=2,
                                                  acceptance=acceptance))  # fmt: skip
    outs = [o for o in engine.stream() if o.finished]
    assert len(outs) == N and all(len(o.output_ids) == 2 for o in outs)
    p1 = main_probs([PROMPT], temperature)[0]
    p2_given_t1 = main_probs([PROMPT + [t] for t in range(cfg.vocab_size)], temperature)
    marginal = p1 @ p2_given_t1
    counts1 = np.bincount([o.output_ids[0] for o in outs], minlength=cfg.vocab_size)
    counts2 = np.bincount([o.output_ids[1] for o in outs], minlength=cfg.vocab_size)
    for counts, probs in ((counts1, p1), (counts2, marginal)):
        stat, df = chi2_stat(counts, probs, N)
        assert stat < chi2_critical(df), f"chi2={stat:.1f} > critical {chi2_critical(df):.1f} (df={df})"
    assert engine.metrics.num_verify_steps == N


def test_chi2_detects_a_wrong_distribution():
    """The test above can fail: samples from a different temperature are rejected."""
    cfg, _ = cached_model()
    p = main_probs([PROMPT], 1.0)[0]
    wrong = main_probs([PROMPT], 0.5)[0]
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(cfg.vocab_size, size=N, p=wrong / wrong.sum()), minlength=cfg.vocab_size)
    stat, df = chi2_stat(counts, p, N)
    assert stat > chi2_critical(df)
