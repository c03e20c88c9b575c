"""Thin nn.Module wrappers that give each engine graph its exact I/O contract (docs/ENGINE_FORMAT.md).

Owns the wrappers and the example inputs used to trace them. The contract itself (graph names, input and
output names, dtypes, dims) is models/engine_format/graph_io.py, shared with the executors; it is
re-exported here for the exporter. The math is not here: every wrapper calls a method of models/glm4_moe.py
(`forward_main` + `compute_logits`, `forward_draft`, `forward_commit`), so there is one copy of it.

Hidden states cross graph boundaries as float32 whatever the engine dtype (the executor contract in
runtime/executors/base.py is float32); the wrappers cast at the edges, as the torch executor does.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from models.engine_format.graph_io import SPECS, draft_graph_module
from models.gdn import GDNStateRef, HybridCache
from models.glm4_moe import Glm4MoeMTPModel
from models.layers import PagedKV, StepMeta
from plugins.gdn_pool import GDNPoolGeometry
from plugins.kv_pool import KVPoolGeometry


class MainGraph(nn.Module):
    def __init__(self, model: Glm4MoeMTPModel, geom: KVPoolGeometry) -> None:
        super().__init__()
        self.model, self.geom = model, geom

    def forward(self, input_ids, positions, q_counts, kv_lens, block_tables, logit_rows, kv_pool_ptr):
        meta = StepMeta(positions, q_counts, kv_lens, block_tables)
        hidden = self.model.forward_main(input_ids, meta, PagedKV(kv_pool_ptr, self.geom))
        return hidden.float(), self.model.compute_logits(hidden[logit_rows])


class HybridMainGraph(nn.Module):
    """The main graph of a hybrid (Gated DeltaNet) model: plus the state slots and the state pools' addresses."""

    def __init__(self, model: Glm4MoeMTPModel, geom: KVPoolGeometry, state: GDNPoolGeometry) -> None:
        super().__init__()
        self.model, self.geom, self.state = model, geom, state

    def forward(self, input_ids, positions, q_counts, kv_lens, block_tables, logit_rows, state_read_slots,
                state_write_slots, kv_pool_ptr, conv_pool_ptr, ssm_pool_ptr):  # fmt: skip
        meta = StepMeta(positions, q_counts, kv_lens, block_tables)
        cache = HybridCache(PagedKV(kv_pool_ptr, self.geom), GDNStateRef(conv_pool_ptr, ssm_pool_ptr, self.state),
                            state_read_slots, state_write_slots)  # fmt: skip
        hidden = cast(Any, self.model).forward_main(input_ids, meta, cache)  # the hybrid model's: takes a HybridCache
        return hidden.float(), self.model.compute_logits(hidden[logit_rows])


class DraftGraph(nn.Module):
    """One draft depth with MTP module `module` (a per-module family's `mtp_draft_{module}`; graph_io.py)."""

    def __init__(self, model: Glm4MoeMTPModel, geom: KVPoolGeometry, module: int = 0) -> None:
        super().__init__()
        self.model, self.geom, self.module = model, geom, module
        self.dtype = next(model.parameters()).dtype

    def forward(self, hidden_in, token_ids, positions, counts, block_tables, kv_pool_ptr):
        kv = PagedKV(kv_pool_ptr, self.geom)
        hidden, logits = self.model.forward_draft(
            hidden_in.to(self.dtype), token_ids, positions, counts, block_tables, kv, mtp_index=self.module
        )
        return hidden.float(), logits


class CommitGraph(nn.Module):
    def __init__(self, model: Glm4MoeMTPModel, geom: KVPoolGeometry) -> None:
        super().__init__()
        self.model, self.geom = model, geom
        self.dtype = next(model.parameters()).dtype

    def forward(self, hidden_in, token_ids, counts, starts, block_tables, kv_pool_ptr):
        kv = PagedKV(kv_pool_ptr, self.geom)
        return self.model.forward_commit(hidden_in.to(self.dtype), token_ids, counts, starts, block_tables, kv)


__all__ = ["SPECS", "WRAPPERS", "example_inputs", "wrapper"]  # SPECS re-exported for builder/export.py

WRAPPERS: dict[str, type[nn.Module]] = {"main": MainGraph, "mtp_draft": DraftGraph, "mtp_commit": CommitGraph}


def wrapper(name: str, model: Glm4MoeMTPModel, geom: KVPoolGeometry, state: GDNPoolGeometry | None) -> nn.Module:
    """Graph `name`'s wrapper; `state`: the GDN state pool of a hybrid model (only its main graph takes it)."""
    if name == "main" and state is not None:
        return HybridMainGraph(model, geom, state)
    module = draft_graph_module(name)
    if module is not None:
        return DraftGraph(model, geom, module)
    return WRAPPERS[name](model, geom)


def example_inputs(name: str, hidden_size: int, max_blocks: int, hybrid: bool = False) -> tuple[torch.Tensor, ...]:
    """Trace-time inputs: distinct sizes per dynamic dim so the exporter does not specialize them to 1/equal.

    The pool addresses are 0 in tracing: plugin ops run as fake (shape-only) implementations there.
    """
    r, t, n = 3, 7, 5
    i32, i64 = torch.int32, torch.int64
    bt = torch.zeros(r, max_blocks, dtype=i32)
    ptr = torch.zeros(1, dtype=i64)
    if name == "main" and hybrid:
        return (torch.zeros(t, dtype=i64), torch.arange(t, dtype=i64), torch.tensor([4, 2, 1], dtype=i32),
                torch.tensor([4, 2, 1], dtype=i32), bt, torch.arange(2, dtype=i64), torch.zeros(r, dtype=i32),
                torch.full((t,), -1, dtype=i32), ptr, ptr.clone(), ptr.clone())  # fmt: skip
    if name == "main":
        return (torch.zeros(t, dtype=i64), torch.arange(t, dtype=i64), torch.tensor([4, 2, 1], dtype=i32),
                torch.tensor([4, 2, 1], dtype=i32), bt, torch.arange(2, dtype=i64), ptr)  # fmt: skip
    if draft_graph_module(name) is not None:
        return (torch.zeros(r, hidden_size), torch.zeros(r, dtype=i64), torch.zeros(r, dtype=i64),
                torch.ones(r, dtype=i32), bt, ptr)  # fmt: skip
    if name == "mtp_commit":
        return (torch.zeros(n, hidden_size), torch.zeros(n, dtype=i64), torch.tensor([3, 2, 0], dtype=i32),
                torch.zeros(r, dtype=i32), bt, ptr)  # fmt: skip
    raise KeyError(name)
