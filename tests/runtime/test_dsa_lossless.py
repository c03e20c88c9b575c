"""Invariant 4 (lossless) on DeepSeek Sparse Attention models: greedy output of tiny DeepSeek-V3.2 / GLM-5
checkpoints (index_topk 8, contexts up to ~38 tokens: every request crosses it) through the Python API with the torch
executor (latent pool + indexer-key planes) is token-identical for K = 0..3, with chunked prefill, prefix caching,
copy-on-write and preemption, and K=0 equals transformers' plain greedy generate. The MTP layer drafts with its own
indexer over the keys the commit pass wrote: its drafts are accepted (acceptance > 0.1 at depth 0)."""

from __future__ import annotations

import pytest

from models.testing_dsa import DSA_VARIANTS, make_dsa_checkpoint
from tests.runtime.engine_utils import hf_greedy_ids
from tests.runtime.test_mla_lossless import PARAMS, PROMPTS, VOCAB, run


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict = {}

    def get(variant: str):
        if variant not in made:
            model_type, overrides = DSA_VARIANTS[variant]
            made[variant] = tmp_path_factory.mktemp(variant)
            make_dsa_checkpoint(made[variant], model_type, seed=6, **{**overrides, "vocab_size": VOCAB})
        return made[variant]

    return get


@pytest.fixture(scope="module")
def reference(checkpoint):
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = run(checkpoint(variant), 0, enable_prefix_caching=False)[0]
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", list(DSA_VARIANTS))
def test_reference_matches_hugging_face_greedy(checkpoint, reference, variant):
    transformers = pytest.importorskip("transformers")
    path = checkpoint(variant)
    cls = transformers.DeepseekV32ForCausalLM if variant == "dsv32" else transformers.GlmMoeDsaForCausalLM
    assert hf_greedy_ids(cls, path, PROMPTS, PARAMS.max_tokens) == reference(variant)


# each K once, both families; chunk 6 splits prompts mid-block and across blocks (test time: docs/MODELS.md)
@pytest.mark.parametrize("variant, k, chunk", [("glm5", 1, 256), ("dsv32", 2, 6), ("glm5", 3, 6)])
def test_mtp_greedy_is_lossless(checkpoint, reference, variant, k, chunk):
    got, engine = run(checkpoint(variant), k, max_prefill_chunk=chunk)
    assert got == reference(variant)
    assert engine.metrics.prefix_hit_tokens > 0  # the shared prompts really hit the cache
    assert engine.executor.geom.num_planes == 2 * (engine.model_cfg.num_hidden_layers + 1)  # + indexer-key planes
    assert engine.metrics.acceptance_rate_per_position[0] > 0.1, "accepted drafts must be exercised"


@pytest.mark.parametrize("variant", ["glm5"])
def test_lossless_with_copy_on_write_prefix_hits_and_preemption(checkpoint, reference, variant):
    got, engine = run(checkpoint(variant), 2, prefix_cache_cow=True)
    assert got == reference(variant) and engine.kv.stats.num_cow_copies > 0
    got, engine = run(checkpoint(variant), 3, num_blocks=20, max_seq_len=64)
    assert got == reference(variant) and engine.metrics.num_preemptions > 0


def test_the_start_up_self_check_runs_on_this_family(checkpoint):
    """Issue 29: the acceptance self-check drafts through the MTP layer's own indexer and judges the acceptance; the
    random MTP layer agrees with the main model by chance only, which it calls low."""
    from runtime.core.self_check import run_self_check

    ran = run_self_check(run(checkpoint("glm5"), 3)[1])
    assert ran is not None
    result, _ = ran
    assert result.verdict == "low" and result.drafted > 0 and result.positions == 2, result
