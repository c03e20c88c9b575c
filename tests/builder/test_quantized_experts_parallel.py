"""builder/quantized_weights.py on a multi-rank `mtp::moe_experts` (the rewrite alone, without a build): a rank's
routed experts are stored in the format like a single rank's, and the node becomes the format's exchange op with the
node's num_experts, ep_size, tp_size and tp_rank. With EP = TP the exchange moves no token (the column's experts are
all on the rank), so the rewritten program runs in one process: this rank's partial output, exactly the format's
reference over this rank's quantized experts at its column's offset. (The token exchange itself runs under mpirun in
tests/plugins/test_moe.py; whole EP2 / TP2 engines in test_int8_quantize.py, test_fp8_native.py and
test_quantize_multirank.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plugins.ops  # noqa: F401  (mtp::moe_experts and its fake)
from builder.quantized_weights import int4_weights, int8_weights
from plugins.reference import moe_experts_int4_ref, moe_experts_int8_ref, quantize_int4, quantize_int8

E, LOCAL, H, INTER, GROUP = 4, 2, 64, 32, 32  # 4 experts, 2 on each rank; hidden, expert width, int4 group


class RankExperts(nn.Module):
    """One rank's routed experts: LOCAL of E, called as the models call them (models/feed_forward.py)."""

    def __init__(self, ep_size: int, tp_size: int, tp_rank: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.w_gate_up = nn.Parameter(torch.randn(LOCAL, 2 * INTER, H, generator=gen) * 0.1)
        self.w_down = nn.Parameter(torch.randn(LOCAL, H, INTER, generator=gen) * 0.1)
        self.parallel = (ep_size, tp_size, tp_rank)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.mtp.moe_experts(x, ids, weights, self.w_gate_up, self.w_down, E, *self.parallel)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, H, generator=gen)
    ids = torch.argsort(torch.rand(6, E, generator=gen), dim=1)[:, :2]  # 2 distinct experts per token, any rank's
    return x, ids, torch.rand(6, 2, generator=gen)


def _quantized(fmt: str, ep_size: int, tp_size: int, tp_rank: int) -> tuple[RankExperts, torch.export.ExportedProgram]:
    model = RankExperts(ep_size, tp_size, tp_rank).eval()
    program = torch.export.export(model, _inputs())
    stats = int8_weights(program, prefix="") if fmt == "int8" else int4_weights(program, GROUP, prefix="")
    assert stats[f"{fmt}_experts"] == 1 and stats[f"{fmt}_names"] == ["w_down", "w_gate_up"]
    return model, program


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("ep_size,tp_size,tp_rank", [(2, 1, 0), (2, 2, 1), (4, 2, 0)])
def test_the_experts_node_becomes_the_formats_exchange(fmt, ep_size, tp_size, tp_rank):
    _, program = _quantized(fmt, ep_size, tp_size, tp_rank)
    nodes = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.mtp.moe_experts.default not in {n.target for n in nodes}
    (node,) = [n for n in nodes if n.target is getattr(torch.ops.mtp, f"moe_experts_{fmt}_exchange").default]
    group = [GROUP] if fmt == "int4" else []
    assert list(node.args[7:]) == [*group, E, ep_size, tp_size, tp_rank]
    dtype = torch.int8 if fmt == "int8" else torch.uint8
    assert program.state_dict["w_gate_up"].dtype == dtype and program.state_dict["w_gate_up"].shape[0] == LOCAL


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tp_rank_computes_its_column_in_the_format(fmt, tp_rank):
    """TP2 with EP2: tp_rank t holds experts 2t, 2t+1; its output is their share of every token, the others 0."""
    model, program = _quantized(fmt, 2, 2, tp_rank)
    x, ids, weights = _inputs()
    with torch.no_grad():
        if fmt == "int8":
            stored = [*quantize_int8(model.w_gate_up), *quantize_int8(model.w_down)]
            want = moe_experts_int8_ref(x, ids, weights, *stored, expert_offset=tp_rank * LOCAL)
        else:
            stored = [*quantize_int4(model.w_gate_up, GROUP), *quantize_int4(model.w_down, GROUP)]
            want = moe_experts_int4_ref(x, ids, weights, *stored, GROUP, expert_offset=tp_rank * LOCAL)
        got = program.module()(x, ids, weights)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
