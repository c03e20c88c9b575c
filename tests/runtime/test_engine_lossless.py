"""Invariant 4 (lossless): greedy output is token-identical with MTP off, with MTP on for every k, chunk
size, batch mix, prefix-cache state and preemption, and identical to Hugging Face greedy generate."""

from __future__ import annotations

import pytest
import torch

from runtime.core.sampling import SamplingParams
from tests.runtime.engine_utils import cached_model, make_engine, random_prompts

PROMPTS = random_prompts((5, 13, 9, 22, 3, 17), seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PROMPTS.append(list(PROMPTS[1]))  # the same prompt twice
PROMPTS.append(PROMPTS[3][:16] + [7, 8, 9])  # diverges right at a block boundary: the last matched block's
assert PROMPTS[3][16] != 7  # MTP entry pairs with a different next token, so it cannot be reused as is
PARAMS = SamplingParams(max_tokens=24)


def run(engine, prompts=PROMPTS, params=PARAMS):
    outs = engine.generate(prompts, params)
    engine.kv.assert_no_leaks()
    assert engine.kv.num_free_blocks == engine.cfg.num_blocks - 1, "KV blocks leaked"
    return [o.output_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    return run(make_engine(0, enable_prefix_caching=False))


def test_reference_matches_hugging_face(tmp_path, reference):
    transformers = pytest.importorskip("transformers")
    from models.checkpoint_export import save_hf_checkpoint, to_hf_config

    cfg, model = cached_model()
    save_hf_checkpoint(model, to_hf_config(cfg), tmp_path)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(str(tmp_path)).eval()
    for prompt, ours in zip(PROMPTS, reference, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False)
        assert out[0, len(prompt) :].tolist() == ours


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [256, 6, 3])  # 6 and 3 split prompts mid-block and across blocks
def test_mtp_greedy_is_lossless(reference, k, chunk):
    engine = make_engine(k, max_prefill_chunk=chunk, block_size=4 if k < 4 else 8)
    assert run(engine) == reference
    assert engine.metrics.prefix_hit_tokens > 0  # the shared prompts really hit the cache


@pytest.mark.parametrize("k", [1, 2])
def test_lossless_with_copy_on_write_prefix_hits(reference, k):
    """Prefix hits keep every matched block and recompute only the last matched token in a private copy."""
    engine = make_engine(k, prefix_cache_cow=True)
    assert run(engine) == reference
    assert engine.kv.stats.num_cow_copies > 0
    # more reuse than giving up the whole last block: prompt 6 shares 4 full blocks (16 tokens) with prompt 3
    assert engine.metrics.prefix_hit_tokens > make_engine_hits(k)


def test_without_mtp_every_full_block_is_reusable(reference):
    """K = 0: blocks hold no draft entries, so no block is given up for its next token."""
    engine = make_engine(0)
    assert run(engine) == reference
    assert engine.kv.stats.num_cow_copies == 0
    assert engine.metrics.prefix_hit_tokens > make_engine_hits(2)


def make_engine_hits(k: int) -> int:
    engine = make_engine(k)
    run(engine)
    return engine.metrics.prefix_hit_tokens


def test_lossless_under_preemption(reference):
    """A pool too small for all requests at once forces preemption and recompute."""
    engine = make_engine(3, num_blocks=24, max_seq_len=64)
    assert run(engine) == reference
    assert engine.metrics.num_preemptions > 0


def test_lossless_tight_token_budget(reference):
    """A budget that admits one decode row + a small chunk: batches mix prefill chunks and decode rows."""
    engine = make_engine(2, max_batch=2, max_num_tokens=6, max_prefill_chunk=5)
    assert run(engine) == reference


def test_lossless_without_commit_pass(reference):
    """The ablation changes acceptance, never outputs."""
    assert run(make_engine(3, commit_pass=False)) == reference


@pytest.fixture(scope="module")
def ort_engine_dir(tmp_path_factory):
    """The same random model built into an onnxruntime engine with mtp-build."""
    from builder import cli
    from models.checkpoint_export import save_hf_checkpoint, to_hf_config

    cfg, model = cached_model()
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(model, to_hf_config(cfg), ckpt)
    out = tmp_path_factory.mktemp("engine") / "tiny"
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none", "--max-batch", "4", "--max-num-tokens", "64",
            "--max-seq-len", "128", "--kv-block-size", "4", "--num-draft-tokens", "3"]  # fmt: skip
    assert cli.main(argv) == 0
    return out


@pytest.mark.parametrize("k,chunk", [(0, 64), (3, 64), (2, 5)])
def test_onnxruntime_executor_is_lossless(reference, ort_engine_dir, k, chunk):
    from runtime.factory import create_engine

    engine = create_engine(ort_engine_dir, executor="onnxruntime", num_draft_tokens=k, max_prefill_chunk=chunk,
                           num_blocks=200)  # fmt: skip
    assert run(engine) == reference


def test_engines_sharing_one_executor_take_turns_losslessly(reference, ort_engine_dir):
    """The bench's K variants run on one executor (the same weights in memory, one KV pool): taking turns,
    each is lossless and leaves the pool as it found it; a pool of another geometry is refused in one line."""
    from runtime.core.config import ConfigError
    from runtime.factory import create_engine

    def make(k, **kw):
        kw = {"num_blocks": 200, "enable_prefix_caching": False, **kw}
        return create_engine(ort_engine_dir, executor="onnxruntime", num_draft_tokens=k, **kw)

    owner = make(3)
    k0, auto = make(0, share_executor_of=owner), make("auto", share_executor_of=owner)
    assert k0.executor is owner.executor is auto.executor
    for engine in (k0, auto, owner, k0, auto):
        assert run(engine) == reference
    with pytest.raises(ConfigError, match=r"num_blocks.* = \(200, 4\).*asks for \(150, 4\)"):
        make(0, num_blocks=150, share_executor_of=owner)
    with pytest.raises(ConfigError, match="enable_prefix_caching=False"):  # a cached block would be overwritten
        make(0, enable_prefix_caching=True, share_executor_of=owner)


def test_prefill_chunks_never_exceed_the_chunk_size():
    engine = make_engine(2, max_prefill_chunk=5, max_num_tokens=64)
    sizes = []
    real_schedule = engine.scheduler.schedule

    def spy():
        out = real_schedule()
        sizes.extend(s.num_new_tokens for s in out.scheduled)
        return out

    engine.scheduler.schedule = spy
    engine.generate(PROMPTS[:4], PARAMS)
    assert max(sizes) == 5
