"""The draft loop in one call (issue 27): the engine's K draft depths unrolled in one traced module, compiled into
the package `mtp_draft.aoti_fused.pt2` of a `--compile aoti` engine with K >= 2 on one rank (compile_aoti.py
`compile_rank`; graph_io.py FUSED_DRAFT_SPEC). The runtime calls it instead of K `mtp_draft` calls when every row of
the step drafts by argmax and the step drafts K deep (runtime/core/draft_loop.py says when; docs/PERFORMANCE.md
"The draft loop in one call?" has the measurements).

Depth d is exactly one `DraftGraph` call (the same wrapper, so the same math and the same float32 hidden at the
depth boundary): it writes the MTP plane at positions + d (base-1+d) and feeds its hidden and its in-graph argmax
token to depth d+1, as the per-depth loop does for the rows that draft by argmax. So only argmax drafting fits it
(no sampled draft, no grammar mask).

Ragged k_i (`depths`, the per-request policy): every row runs all K depths (a fixed shape), and a row at depth
d >= k_i gets the null block (block 0, never a request's) for every column of its block table at that depth, so its
K/V write lands there and its attention reads only there: the request's own blocks are never written past k_i. Its
count stays 1 on purpose: the KV write packs rows by counts (plugins/reference.py kv_write_ref), so a count 0 in the
middle of the batch would hand the next rows' K/V to the wrong requests. The host ignores its drafts past k_i.

Inputs are mtp_draft's (positions: depth 0's, base-1) plus `depths`; the output is the K drafts per row (int64
[R, K]). No hidden comes out: the per-depth loop keeps none past the step (the next step drafts from main hiddens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from builder.export import dynamic_shapes
from builder.graphs import DraftGraph, example_inputs
from models.config import ModelConfig
from models.engine_format.graph_io import DRAFT_GRAPH, FUSED_DRAFT_SPEC, draft_graphs
from models.glm4_moe import Glm4MoeMTPModel
from plugins.kv_pool import KVPoolGeometry

NULL_BLOCK = 0  # runtime/core/block_pool.py NULL_BLOCK_ID: the reserved block no request owns


def fused_modules(cfg: ModelConfig, k: int) -> list[int]:
    """The MTP module of each of the k depths: module d at depth d, the last one past it (the runtime's default
    per-depth policy, runtime/executors/base.py draft_module; the executor skips the package under another)."""
    last = len(draft_graphs(cfg)) - 1
    return [min(d, last) for d in range(k)]


class FusedDraftGraph(nn.Module):
    """`modules[d]`: the MTP module depth d runs (runtime/executors/base.py draft_module); len(modules) = K."""

    def __init__(self, model: Glm4MoeMTPModel, geom: KVPoolGeometry, modules: Sequence[int]) -> None:
        super().__init__()
        self.model = model  # registered once; the depths below share its parameters
        self.depths = [DraftGraph(model, geom, m) for m in modules]  # a plain list: not submodules (no duplicates)

    def forward(self, hidden_in, token_ids, positions, counts, block_tables, depths, kv_pool_ptr):
        hidden, token, drafts = hidden_in, token_ids, []
        null = torch.full_like(block_tables, NULL_BLOCK)
        for d, depth in enumerate(self.depths):
            tables = torch.where((depths > d).unsqueeze(1), block_tables, null)  # past k_i: the null block only
            hidden, logits = depth(hidden, token, positions + d, counts, tables, kv_pool_ptr)
            token = logits.argmax(dim=1)  # first maximum, as numpy's argmax on the host
            drafts.append(token)
        return torch.stack(drafts, dim=1)


def example_fused_inputs(hidden_size: int, max_blocks: int) -> tuple[torch.Tensor, ...]:
    """mtp_draft's trace-time inputs with `depths` (ragged: 0, 1, 2 for the 3 example rows) before the pool address."""
    *step, ptr = example_inputs(DRAFT_GRAPH, hidden_size, max_blocks)
    return (*step, torch.arange(len(step[0]), dtype=torch.int64), ptr)


def export_fused(model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, modules: Sequence[int]):
    """torch.export of the fused module with its contract's dynamic dims (`requests`, `max_blocks`)."""
    module = FusedDraftGraph(model, geom, modules).eval()
    args = example_fused_inputs(model.cfg.hidden_size, max_blocks)
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes(FUSED_DRAFT_SPEC), strict=False)
