"""Invariant 4 (lossless) on MLA models: greedy output of tiny DeepSeek-V3 / GLM-4.7-Flash checkpoints through the
Python API with the torch executor (latent KV pool) is token-identical for K = 0..3, chunked prefill and prefix
caching, and equals transformers' plain greedy generate."""

from __future__ import annotations

import pytest

from models.testing import MLA_VARIANTS, make_mla_checkpoint
from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import greedy_run, hf_greedy_ids, random_prompts

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted drafts happen
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PROMPTS.append(list(PROMPTS[1]))  # the same prompt twice
PROMPTS.append(PROMPTS[3][:16] + [(PROMPTS[3][16] + 1) % VOCAB, 2])  # diverges at a block boundary: copy on write
PARAMS = SamplingParams(max_tokens=16)
VARIANTS = ["dsv3_yarn", "glm_lite"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict = {}

    def get(variant: str):
        if variant not in made:
            model_type, overrides = MLA_VARIANTS[variant]
            made[variant] = tmp_path_factory.mktemp(variant)
            make_mla_checkpoint(made[variant], model_type, seed=2, **{**overrides, "vocab_size": VOCAB})
        return made[variant]

    return get


def run(path, k: int, **rc):
    return greedy_run(path, k, PROMPTS, PARAMS, **rc)


@pytest.fixture(scope="module")
def reference(checkpoint):
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = run(checkpoint(variant), 0, enable_prefix_caching=False)[0]
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_matches_hugging_face_greedy(checkpoint, reference, variant):
    transformers = pytest.importorskip("transformers")
    path = checkpoint(variant)
    cls = transformers.DeepseekV3ForCausalLM if variant.startswith("dsv3") else transformers.Glm4MoeLiteForCausalLM
    assert hf_greedy_ids(cls, path, PROMPTS, PARAMS.max_tokens) == reference(variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("chunk", [256, 6])  # 6 splits prompts mid-block and across blocks
def test_mtp_greedy_is_lossless(checkpoint, reference, variant, k, chunk):
    got, engine = run(checkpoint(variant), k, max_prefill_chunk=chunk)
    assert got == reference(variant)
    assert engine.metrics.prefix_hit_tokens > 0  # the shared prompts really hit the cache
    assert engine.executor.geom.kv_kind == 1 and engine.executor.geom.num_kv_heads == 1  # the latent pool
    assert engine.metrics.acceptance_rate_per_position[0] > 0.1, "accepted drafts must be exercised"


@pytest.mark.parametrize("variant", VARIANTS)
def test_lossless_with_copy_on_write_prefix_hits_and_preemption(checkpoint, reference, variant):
    got, engine = run(checkpoint(variant), 2, prefix_cache_cow=True)
    assert got == reference(variant) and engine.kv.stats.num_cow_copies > 0
    got, engine = run(checkpoint(variant), 3, num_blocks=20, max_seq_len=64)
    assert got == reference(variant) and engine.metrics.num_preemptions > 0
