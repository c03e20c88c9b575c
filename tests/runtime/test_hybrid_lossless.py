"""Invariant 4 (lossless) on hybrid Gated-DeltaNet models (Qwen3-Next, Qwen3.5 MoE and dense): greedy output through the
Python API with the torch executor is token-identical for K = 0..3, a prefill chunk shorter than the prompts,
preemption and mixed batches, and K=0 equals transformers' greedy generate. The recurrent state is rolled back to
the accepted row by a slot choice (runtime/core/state_pool.py); a planted off-by-one slot breaks the output, a poisoned
state pool does not. Sampling with rejection acceptance stays lossless (chi-square against transformers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.testing import make_hybrid_checkpoint
from runtime.core.cost_model import CostCurve, CostModel
from runtime.core.sampling import SamplingParams
from runtime.core.state_pool import StateSlots
from runtime.core.verify_lengths import AcceptancePolicy, FixedPattern
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts
from tests.runtime.test_sampling_lossless import chi2_critical, chi2_stat

transformers = pytest.importorskip("transformers")

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted AND rejected drafts
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)
PROMPTS.append(list(PROMPTS[1]))  # the same prompt twice (prefix hits: tests/runtime/test_hybrid_prefix_cache.py)
PARAMS = SamplingParams(max_tokens=16)
TYPES = ["qwen3_next", "qwen3_5_moe", "qwen3_5_text"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict = {}

    def get(model_type: str):
        if model_type not in made:
            made[model_type] = tmp_path_factory.mktemp(model_type)
            make_hybrid_checkpoint(made[model_type], model_type, seed=2, vocab_size=VOCAB)
        return made[model_type]

    return get


def run(path, k: int | str, prompts=PROMPTS, params=PARAMS, poison: bool = False, verify_lengths=None, **rc):
    opts = dict(num_draft_tokens=k, block_size=4, num_blocks=200, max_batch=4, max_num_tokens=64, max_seq_len=128)
    engine = create_engine(checkpoint=path, executor="torch", verify_lengths=verify_lengths, **{**opts, **rc})
    if poison:  # every state slot NaN: a slot is only ever read after this request wrote it
        engine.executor.state.conv.fill_(float("nan"))
        engine.executor.state.ssm.fill_(float("nan"))
    outs = engine.generate(prompts, params)
    engine.kv.assert_no_leaks()
    assert engine.state_slots.num_free_groups == engine.cfg.max_batch, "state slot groups leaked"
    return [o.output_ids for o in outs], engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    cache: dict = {}

    def get(model_type: str):
        if model_type not in cache:
            cache[model_type] = run(checkpoint(model_type), 0)[0]
        return cache[model_type]

    return get


def load_hf(path, model_type):
    cls = {"qwen3_next": transformers.Qwen3NextForCausalLM, "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
           "qwen3_5_text": transformers.Qwen3_5ForCausalLM}[model_type]  # fmt: skip
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", TYPES)
def test_reference_matches_hugging_face_greedy(checkpoint, reference, model_type):
    hf = load_hf(checkpoint(model_type), model_type)
    for prompt, ours in zip(PROMPTS, reference(model_type), strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False)
        assert out[0, len(prompt) :].tolist() == ours


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("chunk", [256, 6])  # 6: every prompt but two is prefilled in several chunks
def test_mtp_greedy_is_lossless(checkpoint, reference, model_type, k, chunk):
    got, engine = run(checkpoint(model_type), k, max_prefill_chunk=chunk)
    assert got == reference(model_type)
    rate = engine.metrics.acceptance_rate_per_position[0]
    assert 0.1 < rate < 0.9, f"acceptance {rate}: both accepted and rejected drafts (rollbacks) must be exercised"


@pytest.mark.parametrize("model_type", TYPES)
def test_lossless_with_preemption_and_a_poisoned_state_pool(checkpoint, reference, model_type):
    got, engine = run(checkpoint(model_type), 3, num_blocks=20, max_seq_len=64, max_prefill_chunk=6, poison=True)
    assert got == reference(model_type) and engine.metrics.num_preemptions > 0


def test_ragged_per_request_lengths_are_lossless(checkpoint, reference):
    """Per-request k_i (forced ragged, runtime/core/verify_lengths.py): each request's state slot is chosen from
    its own accepted count; chunked prefill, a poisoned state pool."""
    got, _ = run(checkpoint("qwen3_next"), 3, max_prefill_chunk=6, poison=True, verify_lengths=FixedPattern((3, 0, 1, 2)))
    assert got == reference("qwen3_next")
    # the default policy: its cost model profiled on the hybrid executor (no state slot read or written)
    got, _ = run(checkpoint("qwen3_next"), "per-request", max_prefill_chunk=6, poison=True)
    assert got == reference("qwen3_next")
    # settled on drafting nothing (drafting priced out by hand), later requests are admitted without their MTP
    # plane (their state slots too see K=0-like steps), with prefix hits on the repeated prompts
    flat = CostCurve((1, 64), (5000, 5000))
    policy = AcceptancePolicy(CostModel(CostCurve((1, 64), (1000, 64000)), flat, flat))
    got, _ = run(checkpoint("qwen3_next"), "per-request", PROMPTS * 3, max_prefill_chunk=6, poison=True,
                 verify_lengths=policy)  # fmt: skip
    assert got == reference("qwen3_next") * 3 and policy.settled_on_nothing


def test_an_off_by_one_state_slot_breaks_the_output(checkpoint, reference, monkeypatch):
    """The lossless tests can fail: keep the state of the row after the accepted one (off by one)."""
    real = StateSlots.commit

    def off_by_one(self, scheduled, updates):
        for g in self._groups.values():
            g.written = {row - 1: slot for row, slot in g.written.items()} | {max(g.written): g.written[max(g.written)]}
        return real(self, scheduled, updates)

    monkeypatch.setattr(StateSlots, "commit", off_by_one)
    got, _ = run(checkpoint("qwen3_next"), 2)
    assert got != reference("qwen3_next")


def test_rejection_sampling_is_lossless(checkpoint):
    """With temperature 1 and rejection acceptance (K=2), tokens 2 and 3 follow transformers' main-model
    distribution: sum over t1 (, t2) of p(t1) p(t2 | t1) (p(t3 | t1, t2)) (chi-square, p = 0.001)."""
    path, n = checkpoint("qwen3_next"), 400
    prompt = PROMPTS[0]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, acceptance="rejection") for s in range(n)]
    engine = create_engine(checkpoint=path, executor="torch", num_draft_tokens=2, block_size=4, num_blocks=400,
                           max_batch=32, max_num_tokens=256, max_seq_len=64)  # fmt: skip
    for p in params:
        engine.add_request(prompt, p)
    outs = np.array([o.output_ids for o in engine.stream() if o.finished])
    assert outs.shape == (n, 3) and engine.metrics.acceptance_rate_per_position[0] > 0.05
    hf = load_hf(path, "qwen3_next")
    with torch.no_grad():

        def probs(prefixes):
            return torch.softmax(hf(torch.tensor(prefixes)).logits[:, -1].double(), -1).numpy()

        p1 = probs([prompt])[0]
        p2 = probs([prompt + [a] for a in range(VOCAB)])  # [t1, t2]
        p3 = probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    marginal2 = p1 @ p2
    marginal3 = np.einsum("a,ab,abc->c", p1, p2, p3)
    for col, expected in ((1, marginal2), (2, marginal3)):
        stat, df = chi2_stat(np.bincount(outs[:, col], minlength=VOCAB), expected, n)
        assert stat < chi2_critical(df), f"token {col + 1}: chi2={stat:.1f} > {chi2_critical(df):.1f} (df={df})"


def test_a_tp_size_that_does_not_split_the_gdn_key_heads_is_refused_with_one_line(checkpoint):
    """GDN layers split by key head (2 here): TP4 is refused while loading, before any rank joins a collective (TP2
    runs: tests/runtime/test_mpi_hybrid.py)."""
    from runtime.core.config import ConfigError

    with pytest.raises(ConfigError) as e:
        create_engine(checkpoint=checkpoint("qwen3_next"), executor="torch", rank=0, world_size=4, tp_size=4,
                      ep_size=4, num_draft_tokens=1, block_size=4, num_blocks=64, max_batch=2, max_num_tokens=32,
                      max_seq_len=64)  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg and "linear_num_key_heads=2 does not split over tp_size 4" in msg, msg


def test_an_executor_with_too_few_state_slots_is_refused(checkpoint):
    from models.checkpoint import load_model
    from runtime.core.config import ConfigError, RuntimeConfig
    from runtime.core.engine import LLMEngine
    from runtime.executors.torch_executor import TorchExecutor

    model, _ = load_model(checkpoint("qwen3_next"))
    executor = TorchExecutor(model, 64, 4, max_batch=2, num_draft_tokens=1)
    with pytest.raises(ConfigError, match="recurrent-state pool has 6 slots but max_batch=4 with num_draft_tokens=2"):
        LLMEngine(executor, model.cfg, RuntimeConfig(max_batch=4, num_draft_tokens=2, block_size=4, num_blocks=64,
                                                     max_num_tokens=64))  # fmt: skip
