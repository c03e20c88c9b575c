"""Tensor-parallel model: the shards of models/sharding.py tile every tensor exactly (GQA, MLA and the hybrid
Qwen3-Next / Qwen3.5 layouts), one Gated DeltaNet layer's rank shards (their own state pools) sum to the whole layer,
and under a real mpirun TP2, TP2xDP2 (EP4 and EP2) and TP4 forward_main / forward_draft / forward_commit equal the
single-rank model within 1e-5 fp32 (tests/models/mpi_tp_worker.py)."""

from __future__ import annotations

import pytest
import torch

from models.checkpoint_hybrid import model_class
from models.config import ModelConfig
from models.gdn import GatedDeltaNet, GDNStatePool, HybridCache
from models.glm4_moe import Glm4MoeMTPModel
from models.layers import StepMeta
from models.sharding import local_shape, shard_pieces, shard_slice
from models.testing import HYBRID_BASE, tiny_config, tiny_mla_config
from plugins.mapping import Parallel, rank_mapping
from tests.mpi_launch import mpirun_path, run_mpi


@pytest.mark.parametrize("world, ep, tp, kv_heads", [(2, 2, 2, 2), (4, 4, 2, 2), (4, 2, 2, 2), (4, 4, 4, 2),
                                                     (4, 4, 4, 4), (2, 2, 1, 2), (2, 1, 1, 2)])  # fmt: skip
def test_shards_tile_every_tensor(world, ep, tp, kv_heads) -> None:
    """Each tensor: every rank's slice has the local model's shape, and each element is held by the ranks that
    need it (TP-split tensors: once per TP group; KV heads replicated when fewer than tp; experts once per EP)."""
    cfg = tiny_config(num_attention_heads=4, num_key_value_heads=kv_heads, n_routed_experts=8)
    with torch.device("meta"):
        full = {k: tuple(v.shape) for k, v in Glm4MoeMTPModel(cfg).state_dict().items()}
    maps = [rank_mapping(r, Parallel(world, ep, tp), cfg.n_routed_experts) for r in range(world)]
    cover = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in full.items()}
    for m in maps:
        with torch.device("meta"):
            local = {k: tuple(v.shape) for k, v in Glm4MoeMTPModel(cfg, mapping=m).state_dict().items()}
        assert local.keys() == full.keys()
        for name, shape in full.items():
            assert local_shape(name, shape, cfg, m) == local[name], name
            s = shard_slice(name, shape, cfg, m)
            cover[name][s if s is not None else ...] += 1
    for name, count in cover.items():
        routed = name.endswith(("w_gate_up", "w_down"))
        kv_replicated = name.split(".")[-2] in ("k_proj", "v_proj") and kv_heads < tp
        want = world // ep if routed else world // tp * (tp // kv_heads if kv_replicated else 1)
        if not routed and shard_slice(name, full[name], cfg, maps[0]) is None:
            want = world  # replicated on every rank
        assert int(count.min()) == int(count.max()) == want, (name, int(count.min()), int(count.max()), want)


def hybrid_config(model_type: str, **overrides) -> ModelConfig:
    """The tiny hybrid of models/testing.py (3 GDN layers, 2 key / 4 value heads, then gated attention) from its dict."""
    dense = {"intermediate_size": 48} if model_type == "qwen3_5_text" else {}
    return ModelConfig.from_hf_dict({**HYBRID_BASE, "model_type": model_type, "mtp_num_hidden_layers": 1, **dense,
                                     **overrides})  # fmt: skip


@pytest.mark.parametrize("cfg", [tiny_mla_config(), hybrid_config("qwen3_next"), hybrid_config("qwen3_5_text"),
                                 hybrid_config("qwen3_next", linear_num_key_heads=4, linear_num_value_heads=8,
                                               num_attention_heads=8, num_key_value_heads=4)],
                         ids=["mla", "qwen3_next", "qwen3_5_dense", "qwen3_next_4_key_heads"])  # fmt: skip
def test_mla_and_hybrid_shards_tile_every_tensor(cfg) -> None:
    """TP2 (and TP4 where the heads allow): each rank's windows (`shard_pieces`: GDN [q | k | v] channels are three)
    have its local model's shapes, and every element of a split tensor is held by exactly one rank of the group."""
    experts = cfg.n_routed_experts if cfg.has_moe else 0
    with torch.device("meta"):
        full = {k: tuple(v.shape) for k, v in model_class(cfg)(cfg).state_dict().items()}
    for tp in (2, 4) if cfg.linear_num_key_heads == 4 else (2,):
        cover = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in full.items()}
        for rank in range(tp):
            m = rank_mapping(rank, Parallel(tp, tp, tp), experts)
            with torch.device("meta"):
                local = {k: tuple(v.shape) for k, v in model_class(cfg)(cfg, mapping=m).state_dict().items()}
            for name, shape in full.items():
                assert local_shape(name, shape, cfg, m) == local[name], name
                for window in shard_pieces(name, shape, cfg, m) or ((...,),):
                    cover[name][window] += 1
        for name, count in cover.items():
            replicated = shard_pieces(name, full[name], cfg, rank_mapping(0, Parallel(tp, tp, tp), experts)) is None
            want = tp if replicated else 1
            assert int(count.min()) == int(count.max()) == want, (name, tp, int(count.min()), int(count.max()))


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_gdn_rank_shards_sum_to_the_whole_layer(model_type) -> None:
    """One GDN layer (Qwen3-Next's projections packed per key head, Qwen3.5's apart): each TP2 rank's layer, built from
    its windows of the whole layer's weights and run over its own state pool (half the heads), gives a partial out_proj
    output; the two partials sum to the whole layer's output over a prefill of two requests and a decode step that
    reads the stored states. (The sum is what the all-reduce computes under mpirun: tests/runtime/test_mpi_hybrid.py.)"""
    cfg = hybrid_config(model_type)
    whole = GatedDeltaNet(cfg, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    counts, i32 = [5, 3], torch.int32
    prefill = torch.randn(sum(counts), cfg.hidden_size, generator=gen)
    decode = torch.randn(len(counts), cfg.hidden_size, generator=gen)
    tables = torch.zeros(len(counts), 1, dtype=i32)

    def run(layer: GatedDeltaNet, tp: int) -> torch.Tensor:
        pool = GDNStatePool.allocate(cfg, 4, tp_size=tp)
        q = torch.tensor(counts, dtype=i32)
        pos = torch.cat([torch.arange(n) for n in counts])
        writes = torch.tensor([-1] * 4 + [0] + [-1] * 2 + [1], dtype=i32)  # each prompt's last row -> slots 0, 1
        first = layer(prefill, StepMeta(pos, q, q, tables), HybridCache(None, pool, torch.zeros(2, dtype=i32), writes))
        one = torch.ones(2, dtype=i32)
        meta = StepMeta(torch.tensor(counts), one, q + 1, tables)
        second = layer(decode, meta, HybridCache(None, pool, torch.tensor([0, 1], dtype=i32), torch.tensor([2, 3], dtype=i32)))
        return torch.cat([first, second])

    with torch.no_grad():
        want = run(whole, 1)
        got = torch.zeros_like(want)
        for rank in range(2):
            m = rank_mapping(rank, Parallel(2, 2, 2), 8)
            part = GatedDeltaNet(cfg, 0, tp_size=2)
            weights = {}
            for name, t in whole.state_dict().items():
                windows = shard_pieces(f"layers.0.linear_attn.{name}", tuple(t.shape), cfg, m)
                weights[name] = torch.cat([t[w] for w in windows]) if windows else t
            part.load_state_dict(weights)
            part.tp_size = 1  # this rank's partial output: the sum over ranks below stands in for the all-reduce
            got += run(part, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_tensor_is_refused_under_tp() -> None:
    cfg = tiny_config()
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        shard_slice("layers.0.self_attn.mystery_proj.weight", (8, 32), cfg, rank_mapping(0, Parallel(2, 2, 2), 4))


MESHES = [(2, 2, 2, "fused"), (4, 4, 2, "fused"), (4, 2, 2, "plain"), (4, 4, 4, "fused")]


@pytest.fixture(scope="module")
def four_rank_results() -> tuple[int, str]:
    """The 4-rank meshes run one after another in one `mpirun -np 4` launch: starting 4 ranks (python, torch,
    mpi4py) on a 2-core machine costs more than their forwards. Each test below checks its own mesh's line."""
    args = [str(a) for world, ep, tp, mode in MESHES if world == 4 for a in (ep, tp, mode)]
    return run_mpi(4, "tests.models.mpi_tp_worker", "4", *args, timeout=400)


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="mpirun not found")
@pytest.mark.parametrize("world, ep, tp, mode", MESHES)
def test_tp_forward_equals_single_rank(request, world, ep, tp, mode) -> None:
    if world == 4:
        code, out = request.getfixturevalue("four_rank_results")
    else:
        code, out = run_mpi(world, "tests.models.mpi_tp_worker", str(world), str(ep), str(tp), mode, timeout=300)
    line = f"world={world} ep={ep} tp={tp} mode={mode}"
    results = [ln for ln in out.splitlines() if ln.startswith("TP_MODEL_RESULT") and ln.endswith(line)]
    assert len(results) == 1, out[-4000:]  # this mesh ran to its end (a failed rank aborts the launch)
    assert "TP_MODEL_RESULT failures=0 " in results[0], out[-4000:]
    assert code == 0 or world == 4, out[-4000:]  # the shared launch's code also reflects the other meshes


def test_load_model_keeps_todays_ep_arguments():
    """Callers passing (ep_rank, ep_size) get today's slices: ep_size 1 on any rank = everything; EP2 = halves."""
    from pathlib import Path

    from models.checkpoint import load_model

    tiny = Path(__file__).resolve().parents[2] / "models" / "tiny"
    full, _ = load_model(tiny)
    replicated, _ = load_model(tiny, ep_rank=1, ep_size=1)  # a DP rank > 0 with replicated experts
    half, _ = load_model(tiny, ep_rank=1, ep_size=2)
    w = full.layers[1].mlp.w_down
    assert torch.equal(replicated.layers[1].mlp.w_down, w)
    assert torch.equal(half.layers[1].mlp.w_down, w[w.shape[0] // 2 :])
