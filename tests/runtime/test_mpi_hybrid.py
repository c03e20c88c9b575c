"""Issues 19, 28 and 29: the families beyond GLM under a real `mpirun -np 2 --oversubscribe` (torch executor, tests/runtime/
mpi_tp_worker.py): Qwen3-Next with expert parallelism (EP2: the Gated DeltaNet layers, their recurrent state pool and
the attention replicated on every rank, the routed experts split; each rank serves its own requests in DP lockstep, an
idle rank's dummy forwards touching no state slot), MiMo with tensor parallelism (TP2: heads, MLP and vocab split), and
Qwen3-Next and DeepSeek-V3 (MLA) with tensor parallelism (TP2: GDN layers split by key head with their value heads and
each rank's state pool holding its heads; MLA heads split with the latent replicated), and the 2026 families with
expert parallelism (EP2, both in one launch: DeepSeek Sparse Attention as GLM-5 and MiMo-V2-Flash, attention, indexer
and sliding-window caches replicated, every MoE layer's routed experts split, GLM-5's MoE MTP layer's included). Greedy output equals one rank's
at K=0 and K=2 (MTP on == MTP off), with 8-token prefill chunks shorter than the prompts, a prefix-cache hit and late
arrivals mixing prefill and decode; the draft acceptances are counted so the K=2 run exercises accepted and rejected
drafts. The same TP2 run on an ONNX Runtime engine built by `mtp-build --world-size 2 --tp-size 2` (each rank its heads,
expert slice and state pool, `--check` passing). Every launch has a timeout (a tp size that does not split the GDN key
heads: tests/runtime/test_hybrid_lossless.py; an engine edited to a whole-model state pool is refused here)."""

from __future__ import annotations

import json

import onnx
import pytest

from builder import cli
from models.engine_format import EngineDirError, load_engine_config
from models.testing import MLA_VARIANTS, make_hybrid_checkpoint, make_mimo_checkpoint, make_mla_checkpoint
from models.testing_dsa import DSA_VARIANTS, make_dsa_checkpoint
from models.testing_mimo_v2 import make_mimo_v2_checkpoint
from tests.builder.engine_edits import copy_engine, edit_config
from tests.runtime.test_mpi_lockstep import pytestmark  # noqa: F401  (skipped without mpirun)
from tests.runtime.test_mpi_tp import launch, single_rank_outputs


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Tiny Qwen3-Next (3 GDN layers + 1 gated attention, 8 routed experts): a 6-token vocab so drafts get accepted."""
    path = tmp_path_factory.mktemp("qwen3_next")
    make_hybrid_checkpoint(path, "qwen3_next", seed=2, vocab_size=6)
    return path


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """Tiny MiMo (Qwen2 trunk, 4 q / 2 KV heads): seed and vocab chosen for varied output with accepted drafts."""
    path = tmp_path_factory.mktemp("mimo")
    make_mimo_checkpoint(path, seed=2, vocab_size=12)
    return path


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """Tiny DeepSeek-V3 (q_lora, 2 dense layers then MoE, attention biases: o_proj's is added once after the TP sum),
    a 6-token vocab so drafts get accepted."""
    path = tmp_path_factory.mktemp("dsv3")
    model_type, overrides = MLA_VARIANTS["dsv3_dense_then_moe_2"]
    make_mla_checkpoint(path, model_type, seed=2, **{**overrides, "vocab_size": 6})
    return path


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    """Tiny GLM-5 (DSA, index_topk 8: the worker's prompts cross it; 8 routed experts in layers 1-2 and the MTP
    layer), a 6-token vocab so drafts get accepted."""
    path = tmp_path_factory.mktemp("glm5")
    model_type, overrides = DSA_VARIANTS["glm5"]
    make_dsa_checkpoint(path, model_type, seed=6, **{**overrides, "vocab_size": 6})
    return path


@pytest.fixture(scope="module")
def mimo_v2(tmp_path_factory):
    """Tiny MiMo-V2-Flash (window 8, three MTP modules, 4 routed experts in layers 1-2), a 6-token vocab."""
    path = tmp_path_factory.mktemp("mimo_v2")
    make_mimo_v2_checkpoint(path, seed=6, vocab_size=6)
    return path


@pytest.fixture(scope="module")
def hybrid_engine(tmp_path_factory):
    """(checkpoint, engine): a 2-layer tiny Qwen3-Next (one GDN, one gated attention: the ONNX export is the slow part)
    built by `mtp-build --world-size 2 --tp-size 2 --ep-size 2` with the worker's limits (block 4, batch 4, 64 tokens,
    K=2): each rank holds half the attention and GDN heads, its state pool, half the experts and of the vocab."""
    root = tmp_path_factory.mktemp("qwen3_next_tp2")
    make_hybrid_checkpoint(root / "ckpt", "qwen3_next", seed=2, vocab_size=6, num_hidden_layers=2,
                           layer_types=["linear_attention", "full_attention"])  # fmt: skip
    assert cli.main(["--checkpoint", str(root / "ckpt"), "--output", str(root / "engine"), "--compile", "none", "--world-size", "2",
                     "--tp-size", "2", "--ep-size", "2", "--max-batch", "4", "--max-num-tokens", "64", "--max-seq-len",
                     "128", "--kv-block-size", "4", "--num-draft-tokens", "2"]) == 0  # fmt: skip
    return root / "ckpt", root / "engine"


def check_against_one_rank(checkpoint, results: dict) -> None:
    """Every K's outputs equal one rank's; the K=2 run accepted some drafts and rejected others."""
    reference = single_rank_outputs(checkpoint)
    for k, res in results.items():
        assert res["outputs"] == reference, f"K={k}"
    accepted, proposed = (sum(sum(rank[i]) for rank in results["2"]["accepted"]) for i in (0, 1))
    assert 0 < accepted < proposed, f"K=2 must accept some drafts and reject others: {accepted} of {proposed}"


def run_two_ranks(checkpoint, tmp_path, tp: int, ep: int, source=None) -> dict:
    """`source` (default: the checkpoint, torch executor) under mpirun -np 2 at K=0 and K=2 vs one rank's outputs."""
    out = tmp_path / "out.json"
    proc = launch(2, source or checkpoint, out, "ok", tp, ep, "0,2", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    check_against_one_rank(checkpoint, results)
    return results


def test_qwen3_next_ep2_equals_single_rank(hybrid, tmp_path):
    results = run_two_ranks(hybrid, tmp_path, tp=1, ep=2)
    for res in results.values():
        assert res["experts"] == [4, 4], "the 8 routed experts must be split over the 2 ranks"
        assert res["heads"] == [4, 4], "attention is replicated (no TP)"
        assert min(res["calls"]) > 0


def test_mimo_tp2_equals_single_rank(mimo, tmp_path):
    results = run_two_ranks(mimo, tmp_path, tp=2, ep=2)
    for res in results.values():
        assert res["heads"] == [2, 2], "the 4 q heads must be split over the TP group"
        assert res["calls"][0] == res["calls"][1] > 0, "the follower replays exactly its leader's calls"


def test_qwen3_next_and_mla_tp2_equal_single_rank(hybrid, mla, tmp_path):
    """TP2 on the torch executor, both checkpoints in one launch (the ranks' start-up is most of its cost): Qwen3-Next's
    GDN layers split by key head (1 of 2 per rank, with its 2 of 4 value heads) and its gated attention's 4 heads; the
    MLA model's 4 heads split with the latent replicated."""
    out = tmp_path / "out.json"
    proc = launch(2, f"{hybrid},{mla}", out, "ok", 2, 2, "0,2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for checkpoint, results, gdn_heads in zip((hybrid, mla), json.loads(out.read_text()), ([2, 2], [None, None]),
                                              strict=True):  # fmt: skip
        check_against_one_rank(checkpoint, results)
        for k, res in results.items():
            assert res["heads"] == [2, 2] and res["gdn_heads"] == gdn_heads, (checkpoint, k, res["heads"])
            assert res["calls"][0] == res["calls"][1] > 0, "the follower replays exactly its leader's calls"
            assert res["prefix_hit_tokens"] > 0, (checkpoint, k)


def test_qwen3_next_tp2_engine_equals_single_rank(hybrid_engine, tmp_path):
    """The onnxruntime TP2 engine: each rank's graphs hold its half of the routed experts and one GdnStep over its GDN
    heads, reading the rank's own state pool (config.json `state` records one rank's heads)."""
    ckpt, engine = hybrid_engine
    assert cli.main(["--check", str(engine)]) == 0
    cfg = load_engine_config(engine)
    assert cfg.state is not None and cfg.world_size == 2 and (cfg.parallel.ep_size, cfg.parallel.tp_size) == (2, 2)
    assert (cfg.state.num_k_heads, cfg.state.num_v_heads) == (1, 2), "one rank's GDN heads: 1 of 2 key, 2 of 4 value"
    for rank in range(2):
        main = onnx.load(str(cfg.graph_file(rank, "main")), load_external_data=False).graph
        gdn = [n for n in main.node if n.op_type == "GdnStep"]
        assert len(gdn) == 1 and {a.name: a.i for a in gdn[0].attribute}["num_v_heads"] == 2, f"rank {rank}"
        experts = {i.name: i.dims[0] for i in main.initializer if i.name.endswith("mlp.w_gate_up")}
        assert experts and set(experts.values()) == {4}, f"rank {rank}: 4 of the 8 routed experts per layer"
    results = run_two_ranks(ckpt, tmp_path, tp=2, ep=2, source=engine)
    for res in results.values():
        assert res["executors"] == ["OrtExecutor"] * 2
        assert res["calls"][0] == res["calls"][1] > 0 and res["prefix_hit_tokens"] > 0


def test_dsa_and_mimo_v2_ep2_equal_single_rank(dsa, mimo_v2, tmp_path):
    """Issue 29: EP2 on the torch executor, both 2026 families in one launch (start-up is most of its cost). Each rank
    holds half the routed experts of every MoE layer (GLM-5's MTP layer is MoE too) and all the attention."""
    out = tmp_path / "out.json"
    proc = launch(2, f"{dsa},{mimo_v2}", out, "ok", 1, 2, "0,2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for checkpoint, results, per_layer in zip((dsa, mimo_v2), json.loads(out.read_text()), ([4, 4, 4], [2, 2]),
                                              strict=True):  # fmt: skip
        check_against_one_rank(checkpoint, results)
        for k, res in results.items():
            assert res["experts_per_layer"] == [per_layer] * 2, (checkpoint, k, "half of every MoE layer's experts")
            assert res["heads"] == [4, 4], (checkpoint, k, "attention is replicated (no TP)")
            assert min(res["calls"]) > 0 and res["prefix_hit_tokens"] > 0, (checkpoint, k)


def test_qwen3_next_engine_edited_to_a_whole_model_state_pool_is_refused_with_one_line(hybrid_engine, tmp_path):
    """A TP2 engine whose config.json records the whole model's GDN heads: each rank's pool holds its own heads only."""
    copy = copy_engine(hybrid_engine[1], tmp_path)
    edit_config(copy, state__num_k_heads=2, state__num_v_heads=4, state__conv_dim=2 * 2 * 8 + 4 * 6)
    with pytest.raises(EngineDirError, match=r"state\.conv_dim=56 but the model, limits and num_draft_tokens give 28") as e:
        load_engine_config(copy)
    assert "\n" not in str(e.value)
