"""builder/rank_graphs.py: which ranks of a multi-rank build share a graph, and the weight swap that writes such a
rank's graph from its template rank's export: byte for byte the file its own export writes. (The builds that use
it are checked end to end under mpirun: tests/builder/test_tp_build.py, tests/runtime/test_mpi_tp.py and
test_mpi_lockstep.py run the DP2 x TP2 / EP4 and EP2 engines of models/tiny against the single rank.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from builder import rank_graphs
from builder.export import export_graph
from models.checkpoint import load_model
from plugins.kv_pool import KVPoolGeometry
from plugins.mapping import Parallel, rank_mapping
from tests.conftest import TINY

GEOM = KVPoolGeometry(4, 65, 4, 2, 32)  # models/tiny: 3 layers + 1 MTP plane, 2 KV heads of 32
MAX_BLOCKS = 16
GRAPH = "mtp_draft"  # the MTP block's routed experts: weights in which EP ranks differ


@pytest.mark.parametrize(
    "world, ep, tp, want",
    [(4, 4, 2, [None, None, 0, 1]), (2, 2, 1, [None, 0]), (2, 2, 2, [None, None]), (4, 4, 1, [None, 0, 0, 0]),
     (4, 2, 2, [None, None, 0, 1])],
    ids=["DP2xTP2-EP4", "EP2", "TP2", "EP4", "DP2xTP2-EP2"],
)  # fmt: skip
def test_ranks_share_a_graph_only_at_the_same_tp_position(world, ep, tp, want):
    assert rank_graphs.templates([rank_mapping(r, Parallel(world, ep, tp), 8) for r in range(world)]) == want


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, dict, dict, Path]:
    """(rank 0's exported draft graph of an EP2 build of models/tiny, rank 0's and rank 1's graph tensors, rank 1's
    own export of the graph)."""
    root = tmp_path_factory.mktemp("rank_graphs")
    tensors, paths = [], []
    for rank in (0, 1):
        model, _ = load_model(TINY, mapping=rank_mapping(rank, Parallel(2, 2, 1), 8))
        (root / f"rank{rank}").mkdir()
        paths.append(root / f"rank{rank}" / f"{GRAPH}.onnx")
        export_graph(GRAPH, model, GEOM, MAX_BLOCKS, paths[-1])
        tensors.append(rank_graphs.graph_tensors(GRAPH, model, GEOM, None))
    return paths[0], tensors[0], tensors[1], paths[1]


def test_swapped_graph_is_the_ranks_own_export(exported, tmp_path):
    template, t0, t1, own = exported
    differ = [n for n in t0 if not torch.equal(t0[n], t1[n])]
    assert any("mlp.w_gate_up" in n for n in differ), differ  # the ranks hold different experts: a real swap
    assert rank_graphs.swappable(template, t0) and rank_graphs.fits(template, rank_graphs.digests(t0), t1)
    out = tmp_path / f"{GRAPH}.onnx"
    data = rank_graphs.swap_weights(template, out, t1)
    assert out.read_bytes() == own.read_bytes()
    assert data.read_bytes() == own.with_name(own.name + ".data").read_bytes()
    assert data.read_bytes() != template.with_name(template.name + ".data").read_bytes()


def test_a_graph_that_does_not_hold_its_weights_as_they_are_is_not_swapped(exported):
    """A template whose initializer differs from the tensor of its name (as a weight the exporter transformed
    would): never copied."""
    template, t0, _, _ = exported
    name = next(n for n in t0 if n.endswith("mtp.0.block.mlp.w_down"))
    assert not rank_graphs.swappable(template, {**t0, name: t0[name] + 1})


def test_a_rank_differing_in_a_tensor_the_graph_may_have_folded_exports_itself(exported):
    """A small tensor outside the graph's initializers in which the ranks differ could have been folded into a
    constant of the template's: refused. So are other tensor names. A large one (over the folding limit) is not."""
    template, t0, t1, _ = exported
    digests = rank_graphs.digests(t0)
    outside = next(n for n in t0 if n.endswith("layers.0.mlp.down_proj.weight"))  # the main trunk's: not in the draft
    assert t0[outside].numel() > rank_graphs.FOLD_INPUT_LIMIT
    assert rank_graphs.fits(template, digests, {**t1, outside: t1[outside] + 1})
    small = next(n for n in t0 if n.endswith("layers.0.input_layernorm.weight"))
    assert t0[small].numel() <= rank_graphs.FOLD_INPUT_LIMIT
    assert not rank_graphs.fits(template, digests, {**t1, small: t1[small] + 1})
    assert not rank_graphs.fits(template, digests, {**t1, "model.extra": torch.zeros(1)})
