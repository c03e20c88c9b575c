"""The draft loop in one graph (issue 27): K draft depths unrolled in one traced module, for measuring against
K calls of `mtp_draft` (runtime/bench/fused_draft.py). Not an engine graph: no build writes it, no executor runs it.

Depth d is exactly one `DraftGraph` call (the same wrapper, so the same math and the same float32 hidden at the
depth boundary): it writes the MTP plane at positions + d (base-1+d) and feeds its hidden and its in-graph argmax
token to depth d+1, as runtime/core/draft_loop.py does for the requests that draft by argmax. So only greedy-style
drafting fits it (no sampled draft, no grammar mask) and every row drafts all K depths (no ragged k_i).

Inputs are mtp_draft's (positions: depth 0's, base-1); outputs the K drafts per row (int64 [R, K]) and the last
depth's hidden (float32 [R, H]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from builder.export import dynamic_shapes
from builder.graphs import DraftGraph, example_inputs
from models.engine_format.graph_io import DRAFT_GRAPH, graph_spec
from models.glm4_moe import Glm4MoeMTPModel
from plugins.kv_pool import KVPoolGeometry


class FusedDraftGraph(nn.Module):
    """`modules[d]`: the MTP module depth d runs (runtime/executors/base.py draft_module); len(modules) = K."""

    def __init__(self, model: Glm4MoeMTPModel, geom: KVPoolGeometry, modules: Sequence[int]) -> None:
        super().__init__()
        self.model = model  # registered once; the depths below share its parameters
        self.depths = [DraftGraph(model, geom, m) for m in modules]  # a plain list: not submodules (no duplicates)

    def forward(self, hidden_in, token_ids, positions, counts, block_tables, kv_pool_ptr):
        hidden, token, drafts = hidden_in, token_ids, []
        for d, depth in enumerate(self.depths):
            hidden, logits = depth(hidden, token, positions + d, counts, block_tables, kv_pool_ptr)
            token = logits.argmax(dim=1)  # first maximum, as numpy's argmax on the host
            drafts.append(token)
        return torch.stack(drafts, dim=1), hidden


def export_fused(model: Glm4MoeMTPModel, geom: KVPoolGeometry, max_blocks: int, modules: Sequence[int]):
    """torch.export of the fused module with mtp_draft's example inputs and dynamic dims (`requests`, `max_blocks`)."""
    module = FusedDraftGraph(model, geom, modules).eval()
    args = example_inputs(DRAFT_GRAPH, model.cfg.hidden_size, max_blocks)
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes(graph_spec(DRAFT_GRAPH)), strict=False)
