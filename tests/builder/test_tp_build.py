"""Multi-rank `mtp-build` (`--tp-size`, `--ep-size`): per-rank shards (an EP2 build's ranks hold their experts),
collective nodes, config.json's mapping, `--check` of each rank's shards and compiled packages, the one-line
refusals of bad combinations, and the ORT engine of each rank under a real mpirun equal to the single-rank torch
model (tests/builder/mpi_tp_engine_worker.py)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import numpy_helper

from builder import cli
from models.checkpoint import load_model
from models.engine_format import load_engine_config
from models.engine_format.directory import sha256_file
from models.testing import make_checkpoint, tiny_config
from plugins.mapping import Parallel
from tests.builder.conftest import LIMITS
from tests.builder.engine_edits import copy_engine, reseal_manifest
from tests.conftest import TINY
from tests.mpi_launch import mpirun_path, run_mpi

needs_mpi = pytest.mark.skipif(mpirun_path() is None, reason="mpirun not found")
# The first test to use tp2 may pay the session's compiled TP2 build (tests/conftest.py tiny_tp2_build: minutes on a
# loaded 2-core machine), as tests/runtime/test_mpi_tp.py's may.
pytestmark = pytest.mark.timeout(2400)


def _argv(ckpt: Path, out: Path, **kw) -> list[str]:
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none"]
    for k, v in {**LIMITS, **kw}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


# tp2 (models/tiny for world 2, TP2, EP2 by default, compiled) is tests/builder/conftest.py's: the session's build,
# shared with test_build_defaults.py and tests/runtime/test_mpi_tp.py.


@pytest.fixture(scope="module")
def tp2dp2(tiny_dp2tp2_ep4_engine) -> Path:
    """The session's 4-rank DP2 x TP2 / EP4 build of models/tiny (tests/conftest.py), shared with
    tests/runtime/test_mpi_tp.py instead of a second 4-rank build of the random tiny checkpoint."""
    return tiny_dp2tp2_ep4_engine


def _nodes(path: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(path), load_external_data=False).graph.node)


def _attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def test_tp_engine_records_mapping_and_collectives(tp2):
    cfg = load_engine_config(tp2)
    assert cfg.parallel == Parallel(world_size=2, ep_size=2, tp_size=2)
    assert cfg.kv.num_kv_heads == 1  # 2 KV heads split over 2 ranks: each pool holds its own
    assert {"AllReduce", "AllGather"} <= set(cfg.plugins["nodes"])
    layers = cfg.model.num_hidden_layers
    for rank in range(2):
        main = _nodes(cfg.graph_file(rank, "main"))
        ops = [n.op_type for n in main]
        # One all-reduce per block output (attention, MLP/MoE) plus the embedding; one all-gather (logits).
        assert ops.count("AllReduce") == 2 * layers + 1 and ops.count("AllGather") == 1
        assert all(_attrs(n)["tp_size"] == 2 for n in main if n.op_type in ("AllReduce", "AllGather"))
        moe = [_attrs(n) for n in main if n.op_type == "MoeExperts"]
        assert moe and all(a["tp_size"] == 2 and a["tp_rank"] == rank and a["ep_size"] == 2 for a in moe)
        commit = [n.op_type for n in _nodes(cfg.graph_file(rank, "mtp_commit"))]
        assert commit.count("AllReduce") == 1 and "AllGather" not in commit  # embedding only: K/V projections


def test_expert_parallel_ranks_hold_their_experts(tiny_ep2_engine):
    """The session's `mtp-build --world-size 2 --ep-size 2` of models/tiny (tests/conftest.py, shared with
    tests/runtime/test_mpi_lockstep.py): each rank's main graph holds exactly its half of the routed experts (rank 1's
    graphs are rank 0's with its weights swapped in: builder/rank_graphs.py). Here, not in test_build.py, so that
    file's single-rank tests stay off the worker of the mpirun group (tests/conftest.py xdist_groups)."""
    out, checkpoint = tiny_ep2_engine, TINY
    cfg = load_engine_config(out)
    assert cfg.world_size == 2 and sorted(p.name for p in out.glob("rank*")) == ["rank0", "rank1"]
    for rank in (0, 1):
        model, _ = load_model(checkpoint, ep_rank=rank, ep_size=2)
        want = model.layers[1].mlp.w_down.detach().numpy()  # experts [4r, 4r+4) of 8
        m = onnx.load(str(out / f"rank{rank}" / "main.onnx"))
        moe = [n for n in m.graph.node if n.op_type == "MoeExperts"]
        assert moe and all(a.i == 2 for n in moe for a in n.attribute if a.name == "ep_size")
        inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        assert any(v.shape == want.shape and (v == want).all() for v in inits.values()), f"rank {rank} experts"
    assert cli.main(["--check", str(out)]) == 0


def test_check_accepts_each_rank(tp2, capsys):
    """`mtp-build --check` checks each rank's graphs, and runs each rank's compiled packages under mpirun against the
    torch model sharded to that rank."""
    assert cli.main(["--check", str(tp2)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 rank(s)" in out, out
    assert "compiled packages of 2 ranks match the torch model (each rank's shard, under mpirun)" in out, out


def test_check_refuses_a_rank_with_the_wrong_shard(tp2, tmp_path, capsys):
    """rank1's q_proj declared with the full head count (what a rank built without --tp-size would hold)."""
    copy = copy_engine(tp2, tmp_path)
    path = copy / "rank1" / "main.onnx"
    model = onnx.load(str(path), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.name == "model.layers.0.self_attn.q_proj.weight")
    init.dims[0] *= 2
    onnx.save(model, str(path))
    reseal_manifest(copy, **{"rank1/main.onnx": sha256_file(path)})
    assert cli.main(["--check", str(copy)]) == 2
    err = capsys.readouterr().err
    want = "rank1/main.onnx: weight model.layers.0.self_attn.q_proj.weight has shape [256, 256], rank 1's shard"
    assert want in err and "is [128, 256]" in err, err


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory) -> Path:
    """6 q heads, 3 KV heads, vocab 98: splits over nothing but 1 (and 3 for heads)."""
    path = tmp_path_factory.mktemp("odd") / "ckpt"
    make_checkpoint(path, tiny_config(num_attention_heads=6, num_key_value_heads=3, vocab_size=98), seed=5)
    return path


@pytest.mark.parametrize(
    "which, flags, message",
    [
        ("tiny", dict(world_size=3, tp_size=2), "--tp-size 2 must divide --world-size 3"),
        (
            "tiny",
            dict(world_size=4, tp_size=2, ep_size=1),
            "--ep-size 1 with --tp-size 2 must be --tp-size (2) or --world-size (4)",
        ),  # fmt: skip
        ("tiny", dict(world_size=8, tp_size=8, ep_size=8), "n_routed_experts=4 does not split over --ep-size 8"),
        ("tiny", dict(world_size=2, tp_size=2, ep_size=2, backend="tensorrt"), "--backend tensorrt"),
        ("odd", dict(world_size=4, tp_size=4, ep_size=4), "num_attention_heads=6 does not split over --tp-size 4"),
        ("odd", dict(world_size=2, tp_size=2, ep_size=2), "num_key_value_heads=3 does not split over --tp-size 2"),
        ("odd", dict(world_size=3, tp_size=3, ep_size=1), "--ep-size 1 with --tp-size 3 must be"),
    ],
    ids=["world", "ep-not-tp-or-world", "experts", "tensorrt", "heads", "kv-heads", "ep-replicated"],
)
def test_bad_tp_combinations_are_refused(checkpoint, odd_checkpoint, tmp_path, capsys, which, flags, message):
    ckpt = checkpoint if which == "tiny" else odd_checkpoint
    out = tmp_path / "engine"
    assert cli.main(_argv(ckpt, out, **flags)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err, err
    assert not out.exists()


def test_vocab_must_split(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, tiny_config(vocab_size=97), seed=5)
    assert cli.main(_argv(ckpt, tmp_path / "engine", world_size=2, tp_size=2, ep_size=2)) == 2
    assert "vocab_size=97 does not split over --tp-size 2" in " ".join(capsys.readouterr().err.split())


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("which, ranks", [("tp2", 2), ("tp2dp2", 4)])
def test_tp_engine_equals_single_rank_under_mpirun(request, which, ranks):
    """Both engines are builds of models/tiny (the session's, tests/conftest.py)."""
    engine = request.getfixturevalue(which)
    code, out = run_mpi(ranks, "tests.builder.mpi_tp_engine_worker", str(engine), str(TINY), timeout=300)
    assert code == 0, out[-4000:]
    assert "TP_ENGINE_RESULT failures=0" in out, out[-4000:]
