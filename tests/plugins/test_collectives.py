"""The TP collectives (`mtp::all_reduce`, `mtp::all_gather`, plugins/collectives.py) under a real mpirun, and
the mapping contract of plugins/mapping.py."""

from __future__ import annotations

import pytest
import torch

from plugins.mapping import MappingError, Parallel, check_model, rank_mapping
from tests.mpi_launch import mpirun_path, run_mpi

needs_mpi = pytest.mark.skipif(mpirun_path() is None, reason="mpirun not found")


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_collectives_equal_numpy_reference(ranks: int) -> None:
    code, out = run_mpi(ranks, "tests.plugins.mpi_collectives_worker", timeout=180)
    assert code == 0, out
    assert f"COLLECTIVES_RESULT failures=0 ranks={ranks}" in out, out


def test_identity_when_tp_is_one() -> None:
    import plugins.collectives  # noqa: F401  (torch.ops.mtp.all_*)

    x = torch.randn(3, 4)
    assert torch.equal(torch.ops.mtp.all_reduce(x, 1), x)
    assert torch.equal(torch.ops.mtp.all_gather(x, 1), x)


def test_rank_mapping_follows_the_contract() -> None:
    # TP2 x DP2, EP4: column t owns experts [t*4, t*4+4) of 8; ep_rank = tp_rank*2 + dp_rank.
    maps = [rank_mapping(r, Parallel(4, 4, 2), num_experts=8) for r in range(4)]
    assert [(m.dp_rank, m.tp_rank, m.ep_rank) for m in maps] == [(0, 0, 0), (0, 1, 2), (1, 0, 1), (1, 1, 3)]
    assert [(m.expert_lo, m.expert_hi) for m in maps] == [(0, 2), (4, 6), (2, 4), (6, 8)]
    assert [m.column_lo for m in maps] == [0, 4, 0, 4] and all(m.exchanges_experts for m in maps)
    # TP2 x DP2, EP2: no exchange; both DP groups hold the same halves.
    maps = [rank_mapping(r, Parallel(4, 2, 2), num_experts=8) for r in range(4)]
    assert [(m.expert_lo, m.expert_hi) for m in maps] == [(0, 4), (4, 8), (0, 4), (4, 8)]
    assert not any(m.exchanges_experts for m in maps)
    # TP1: today's mappings (EP1 replicated, EPW one slice per rank).
    assert [rank_mapping(r, Parallel(2, 2, 1), 8).expert_lo for r in range(2)] == [0, 4]
    assert [rank_mapping(r, Parallel(2, 1, 1), 8).expert_hi for r in range(2)] == [8, 8]


@pytest.mark.parametrize(
    "world, ep, tp, kw, message",
    [
            (3, 1, 2, {}, "tp_size 2 must divide world_size 3"),
        (4, 1, 2, {}, "ep_size 1 with tp_size 2 must be tp_size (2) or world_size (4)"),
        (2, 2, 2, {"num_heads": 5}, "num_attention_heads=5 does not split over tp_size 2"),
        (4, 4, 4, {"num_heads": 6}, "num_attention_heads=6 does not split over tp_size 4"),
        (4, 4, 4, {"num_kv_heads": 6, "num_heads": 12}, "num_key_value_heads=6 does not split"),
        (4, 4, 4, {"num_kv_heads": 3, "num_heads": 12}, "num_key_value_heads=3 cannot be replicated"),
        (2, 2, 2, {"vocab_size": 97}, "vocab_size=97 does not split over tp_size 2"),
        (2, 2, 2, {"num_experts": 3}, "n_routed_experts=3 does not split over ep_size 2"),
        (4, 4, 4, {"gdn_key_heads": 2}, "linear_num_key_heads=2 does not split over tp_size 4"),
        (4, 4, 4, {"mla": True, "num_heads": 6}, "num_attention_heads=6 does not split over tp_size 4"),
    ],
)
def test_bad_mappings_are_refused(world, ep, tp, kw, message) -> None:
    args = {"num_experts": 8, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 96, **kw}
    with pytest.raises(MappingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_model(world, ep, tp, **args)


def test_mla_and_gdn_tensor_parallel_mappings_are_allowed() -> None:
    """MLA splits its heads and replicates the latent (its num_key_value_heads plays no part: 3 does not split over
    2); GDN layers split by key head when tp divides them."""
    args = {"num_experts": 8, "num_heads": 8, "vocab_size": 96}
    check_model(2, 2, 2, num_kv_heads=3, mla=True, **args)
    check_model(4, 4, 4, num_kv_heads=2, gdn_key_heads=4, **args)
