"""Tensor-parallel model: the shards of models/sharding.py tile every tensor exactly, and under a real mpirun
TP2, TP2xDP2 (EP4 and EP2) and TP4 forward_main / forward_draft / forward_commit equal the single-rank model
within 1e-5 fp32 (tests/models/mpi_tp_worker.py)."""

from __future__ import annotations

import pytest
import torch

from models.glm4_moe import Glm4MoeMTPModel
from models.sharding import local_shape, shard_slice
from models.testing import tiny_config
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


def test_unknown_tensor_is_refused_under_tp() -> None:
    cfg = tiny_config()
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        shard_slice("layers.0.self_attn.kv_a_proj_with_mqa.weight", (8, 32), cfg, rank_mapping(0, Parallel(2, 2, 2), 4))


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
