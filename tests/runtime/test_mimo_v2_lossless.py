"""Invariant 4 (lossless) on MiMo-V2-Flash (sliding window 8 with sinks, three MTP modules, depth d runs module d):
greedy output through the Python API with the torch executor is token-identical for K = 0..3 (and K = 4, where the
last module runs twice), chunked prefill, prefix caching (copy on write) and preemption, with prompts and outputs
crossing the window; K=0 equals transformers' greedy generate on the same checkpoint."""

from __future__ import annotations

import pytest

from models.testing_mimo_v2 import make_mimo_v2_checkpoint
from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import greedy_run, hf_greedy_ids, random_prompts

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted drafts happen
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PROMPTS.append(PROMPTS[3][:16] + [(PROMPTS[3][16] + 1) % VOCAB, 2])  # diverges at a block boundary: copy on write
PARAMS = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2")
    make_mimo_v2_checkpoint(path, seed=6, vocab_size=VOCAB)  # varied output, ~15% of depth-0 drafts accepted
    return path


def run(path, k: int, **rc):
    return greedy_run(path, k, PROMPTS, PARAMS, **rc)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return run(checkpoint, 0, enable_prefix_caching=False)[0]


def test_reference_matches_hugging_face_greedy(checkpoint, reference):
    transformers = pytest.importorskip("transformers")
    assert hf_greedy_ids(transformers.MiMoV2FlashForCausalLM, checkpoint, PROMPTS, PARAMS.max_tokens) == reference


@pytest.fixture(scope="module")
def per_depth_k3(checkpoint):
    return run(checkpoint, 3)


@pytest.mark.parametrize("k, chunk", [(1, 256), (3, 6), (3, 256)])  # 6 splits prompts mid-block (K=2: the COW run)
def test_mtp_greedy_is_lossless(checkpoint, reference, per_depth_k3, k, chunk):
    got, engine = per_depth_k3 if (k, chunk) == (3, 256) else run(checkpoint, k, max_prefill_chunk=chunk)
    assert got == reference
    assert engine.metrics.prefix_hit_tokens > 0
    assert engine.metrics.acceptance_rate_per_position[0] > 0.1, "accepted drafts must be exercised"


def test_lossless_with_copy_on_write_prefix_hits_and_preemption(checkpoint, reference):
    got, engine = run(checkpoint, 2, prefix_cache_cow=True)
    assert got == reference and engine.kv.stats.num_cow_copies > 0
    got, engine = run(checkpoint, 3, num_blocks=20, max_seq_len=64)
    assert got == reference and engine.metrics.num_preemptions > 0


def test_depths_past_the_modules_reuse_the_last_and_the_module_choice_is_load_bearing(checkpoint, reference,
                                                                                      per_depth_k3):  # fmt: skip
    """K=4 (module 2 at depths 2 and 3) is lossless; module 0 at every depth ("first") drafts differently at the
    later depths, which changes acceptance (never the output)."""
    got, engine = run(checkpoint, 4, block_size=8)
    assert got == reference and len(engine.metrics.acceptance_rate_per_position) == 4
    per_depth = list(per_depth_k3[1].metrics.acceptance_rate_per_position)
    got, first = run(checkpoint, 3, mtp_modules="first")
    assert got == reference
    assert per_depth != list(first.metrics.acceptance_rate_per_position)


def test_the_start_up_self_check_runs_on_this_family(checkpoint):
    """Issue 29: the acceptance self-check (mtp-run / mtp-serve start-up) drafts through the three modules and judges
    the acceptance; these random modules agree with the main model by chance only (~1/VOCAB), which it calls low."""
    from runtime.core.self_check import run_self_check

    ran = run_self_check(run(checkpoint, 3)[1])
    assert ran is not None
    result, _ = ran
    assert result.verdict == "low" and result.drafted > 0 and result.positions == 2, result
