"""The feed-forward blocks of the GLM-4.5 / DeepSeek-V3 layout: the dense MLP, the router and the MoE.

Owns the sigmoid + correction-bias router with group-limited top-k, the routed experts (one plugin op,
`mtp::moe_experts`, which also does the expert-parallel exchange) plus shared experts, and the inference-only
weight fusion used by models/glm4_moe.py (one [gate; up] GEMM, one QKV GEMM, [in, out] storage).

Tensor parallelism (models/sharding.py decides the slices): the dense MLP and shared experts hold inter/TP
columns of gate/up and the matching rows of down; each block's partial output is summed by ONE
`mtp::all_reduce` (the MoE's covers routed + shared experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import plugins.collectives  # noqa: F401  (torch.ops.mtp.all_reduce)
from models.config import ModelConfig
from plugins.mapping import RankMapping
from plugins.ops import moe_experts_local


class MLP(nn.Module):
    """SwiGLU MLP. tp_size > 1: this rank's inter/tp_size slice; `reduce` = all-reduce the partial output
    here (False for shared experts: the MoE reduces routed + shared once)."""

    def __init__(self, hidden: int, inter: int, tp_size: int = 1, reduce: bool = True) -> None:
        super().__init__()
        self.tp_size, self.reduce = tp_size, reduce and tp_size > 1
        inter //= tp_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # fused [gate; up] weight (fuse())

    def fuse(self) -> None:
        """Inference only: one [gate; up] projection; gate/up_proj become views of it."""
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or torch.is_grad_enabled():
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return torch.ops.mtp.all_reduce(out, self.tp_size) if self.reduce else out


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears over the same input; re-point each at its slice.

    Keeps the checkpoint layout (state_dict names and shapes) while one GEMM replaces several. The
    storage is [in, out] (see `store_in_out`).
    """
    weight = torch.cat([m.weight.detach().t() for m in linears], dim=1).contiguous().t()  # stored [in, out]
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears if m.bias is not None]) if has_bias else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


def store_in_out(linear: nn.Linear) -> None:
    """Keep the weight's shape [out, in] but its storage [in, out] (a transposed view), so F.linear runs as
    x @ W_t. On our CPU this made cold few-row GEMMs 10-60% faster (docs/PERFORMANCE.md). No-op if done."""
    w = linear.weight
    if w.dim() == 2 and w.is_contiguous() and w.shape[0] > 1 and w.shape[1] > 1:
        linear.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)


class Router(nn.Module):
    """Sigmoid scores + correction bias, group-limited top-k (DeepSeek-V3 / GLM-4.5)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:  # else every group is kept: the group mask is a no-op
            choice = self._mask_groups(choice)
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights * self.routed_scaling_factor

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)  # [T, groups]
        grouped = choice.view(-1, self.n_group, per_group).masked_fill(dropped[:, :, None], float("-inf"))
        return grouped.view(-1, self.num_experts)


class MoE(nn.Module):
    """Routed experts (fused canonical layout, one plugin op) + shared experts.

    With expert parallelism this rank holds the experts of its mapping (plugins/mapping.py) and
    the plugin op exchanges tokens with the other ranks; the router is replicated. With tensor parallelism the
    op returns this rank's partial routed sum, the shared experts are column/row-parallel, and one all-reduce
    sums both.
    """

    def __init__(self, cfg: ModelConfig, ep_size: int = 1, mapping: RankMapping | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.ep_size = mapping.ep if mapping else ep_size
        self.tp_size, self.tp_rank = (mapping.tp, mapping.tp_rank) if mapping else (1, 0)
        num_local = cfg.n_routed_experts // self.ep_size
        inter = cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.w_gate_up = nn.Parameter(torch.zeros(num_local, 2 * inter, cfg.hidden_size))  # gate rows, then up rows
        self.w_down = nn.Parameter(torch.zeros(num_local, cfg.hidden_size, inter))
        shared = inter * cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, shared, self.tp_size, reduce=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        args = (x, topk_ids, topk_weights.to(x.dtype), self.w_gate_up, self.w_down, self.num_experts, self.ep_size)
        if self.tp_size == 1:  # the TP1 graph keeps the node it always had
            out = torch.ops.mtp.moe_experts(*args)
        else:
            out = torch.ops.mtp.moe_experts(*args, self.tp_size, self.tp_rank)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return torch.ops.mtp.all_reduce(out, self.tp_size) if self.tp_size > 1 else out

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        """Autograd-able path (plain torch grouped experts); x [..., H]."""
        flat = x.reshape(-1, x.shape[-1])
        topk_ids, topk_weights = self.gate(flat)
        out = moe_experts_local(flat, topk_ids, topk_weights.to(x.dtype), self.w_gate_up, self.w_down, 0)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)
