"""Invariant 4 (lossless) on MiMo (Qwen2 trunk, hidden-first MTP over the pre-norm hidden): greedy output through
the Python API with the torch executor is token-identical for K = 0..3, chunked prefill, prefix caching (copy on
write) and preemption, and K=0 equals transformers' Qwen2 greedy generate on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from models.testing import make_mimo_checkpoint
from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import greedy_run, hf_greedy_ids, random_prompts

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted drafts happen
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PROMPTS.append(PROMPTS[3][:16] + [(PROMPTS[3][16] + 1) % VOCAB, 2])  # diverges at a block boundary: copy on write
PARAMS = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo")
    make_mimo_checkpoint(path, seed=3, vocab_size=VOCAB)  # varied output, ~18% of drafts accepted
    return path


def run(path, k: int, **rc):
    return greedy_run(path, k, PROMPTS, PARAMS, **rc)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return run(checkpoint, 0, enable_prefix_caching=False)[0]


def test_reference_matches_hugging_face_greedy(checkpoint, reference):
    transformers = pytest.importorskip("transformers")
    assert hf_greedy_ids(transformers.Qwen2ForCausalLM, checkpoint, PROMPTS, PARAMS.max_tokens) == reference


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("chunk", [256, 6])  # 6 splits prompts mid-block and across blocks
def test_mtp_greedy_is_lossless(checkpoint, reference, k, chunk):
    got, engine = run(checkpoint, k, max_prefill_chunk=chunk)
    assert got == reference
    assert engine.metrics.prefix_hit_tokens > 0
    assert engine.metrics.acceptance_rate_per_position[0] > 0.1, "accepted drafts must be exercised"


def test_lossless_with_copy_on_write_prefix_hits_and_preemption(checkpoint, reference):
    got, engine = run(checkpoint, 2, prefix_cache_cow=True)
    assert got == reference and engine.kv.stats.num_cow_copies > 0
    got, engine = run(checkpoint, 3, num_blocks=20, max_seq_len=64)
    assert got == reference and engine.metrics.num_preemptions > 0


def test_drafts_use_the_trained_wiring(checkpoint):
    """The MiMo MTP wiring is load-bearing for acceptance: with GLM's embedding-first concatenation planted, the
    drafts change (the output stays lossless: only acceptance moves)."""
    from models.mimo import MiMoMTPModule

    _, engine = run(checkpoint, 1)
    good = list(engine.metrics.acceptance_rate_per_position)
    original = MiMoMTPModule.fuse
    MiMoMTPModule.fuse = lambda self, e, h: self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], -1))
    try:
        _, planted = run(checkpoint, 1)
    finally:
        MiMoMTPModule.fuse = original
    assert list(planted.metrics.acceptance_rate_per_position) != good
