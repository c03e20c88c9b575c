"""`mtp-build --tp-size`: per-rank shards, collective nodes, config.json's mapping, `--check` of each rank's
shards, the one-line refusals of bad combinations, and the ORT engine of each rank under a real mpirun equal to
the single-rank torch model (tests/builder/mpi_tp_engine_worker.py)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from builder import cli
from models.engine_format import load_engine_config
from models.engine_format.directory import sha256_file
from models.testing import make_checkpoint, tiny_config
from plugins.mapping import Parallel
from tests.builder.conftest import LIMITS
from tests.builder.engine_edits import copy_engine, reseal_manifest
from tests.conftest import TINY
from tests.mpi_launch import mpirun_path, run_mpi

needs_mpi = pytest.mark.skipif(mpirun_path() is None, reason="mpirun not found")


def _argv(ckpt: Path, out: Path, **kw) -> list[str]:
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none"]
    for k, v in {**LIMITS, **kw}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


# tp2 (world 2, TP2, EP2 by default) is tests/builder/conftest.py's, shared with test_build_defaults.py.


@pytest.fixture(scope="module")
def tp2dp2(tiny_dp2tp2_ep4_engine) -> tuple[Path, Path]:
    """(engine, its checkpoint): the session's 4-rank DP2 x TP2 / EP4 build of models/tiny (tests/conftest.py),
    shared with tests/runtime/test_mpi_tp.py instead of a second 4-rank build of the random tiny checkpoint."""
    return tiny_dp2tp2_ep4_engine, TINY


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


def test_tp1_engine_has_no_collectives(engine):
    cfg = load_engine_config(engine)
    for graph in cfg.graphs[0]:
        ops = {n.op_type for n in _nodes(cfg.graph_file(0, graph))}
        assert not ops & {"AllReduce", "AllGather"}, graph


def test_check_accepts_each_rank(tp2, capsys):
    assert cli.main(["--check", str(tp2)]) == 0
    assert "2 rank(s)" in capsys.readouterr().out


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
    want = "rank1/main.onnx: weight model.layers.0.self_attn.q_proj.weight has shape [32, 32], rank 1's shard"
    assert want in err and "is [16, 32]" in err, err


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
def test_tp_engine_equals_single_rank_under_mpirun(request, checkpoint, which, ranks):
    engine = request.getfixturevalue(which)
    if isinstance(engine, tuple):  # tp2dp2: a build of another checkpoint
        engine, checkpoint = engine
    code, out = run_mpi(ranks, "tests.builder.mpi_tp_engine_worker", str(engine), str(checkpoint), timeout=300)
    assert code == 0, out[-4000:]
    assert "TP_ENGINE_RESULT failures=0" in out, out[-4000:]
