"""The `torch` executor: runs models/glm4_moe.py directly over a KV pool it allocates once.

On CPU this is the reference executor for the runtime tests. On CUDA (with `cuda_graphs=True`) draft
depths and decode-only verify steps replay CUDA graphs captured per request-count bucket
(runtime/executors/cuda_graphs.py); that path has not been executed on our CPU-only machines.
"""

from __future__ import annotations

import os
import sys
from typing import Any, cast

import numpy as np
import torch

from models.config import kv_geometry_fields
from models.gdn import GDNStatePool, HybridCache
from models.glm4_moe import Glm4MoeMTPModel
from models.layers import PagedKV, StepMeta
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from plugins.mapping import local_kv_heads  # TP: the pool holds this rank's KV heads
from runtime.executors.base import (
    CommitInput,
    DraftInput,
    DraftOutput,
    HybridMainInput,
    MainInput,
    MainOutput,
    draft_module,
)
from runtime.executors.cuda_graphs import GraphedFunction


class TorchExecutor:
    def __init__(self, model: Glm4MoeMTPModel, num_blocks: int, block_size: int, device: str = "cpu",
                 cuda_graphs: bool | str = False, max_batch: int = 8, num_draft_tokens: int = 0,
                 max_blocks_per_request: int = 64, num_state_snapshots: int = 0,
                 mtp_modules: str = "per-depth") -> None:  # fmt: skip
        cfg = model.cfg
        warn_spinning_threads()
        self.model = model.to(device).eval().fuse()  # fused QKV and gate|up: the fast path is the only path
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        kv_heads, head_dim, kv_kind = kv_geometry_fields(cfg)  # MLA: one latent row per position
        self.geom = KVPoolGeometry(
            model.num_kv_planes, num_blocks, block_size, local_kv_heads(kv_heads, model.mapping.tp), head_dim,
            {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[self.dtype], kv_kind,
        )  # fmt: skip
        self.pool = allocate_pool(self.geom, self.device)
        self.kv = PagedKV(pool_address(self.pool), self.geom)
        # Hybrid models: the GDN state pool beside the KV pool, K+2 slots per request, then the state snapshots of
        # prefix caching (runtime/core/state_pool.py, state_snapshots.py)
        slots = max_batch * (num_draft_tokens + 2) + num_state_snapshots
        self.state = (GDNStatePool.allocate(cfg, slots, self.dtype, self.device, model.mapping.tp) if cfg.is_hybrid
                      else None)  # TP: this rank's heads only
        if self.state is not None:
            cuda_graphs = False  # not captured for hybrid models: the state-slot inputs are not graph buffers
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.num_draft_tokens = num_draft_tokens
        self.num_mtp_modules, self.mtp_modules = cfg.num_mtp_modules, mtp_modules  # base.py draft_module
        self.graphed_draft: GraphedFunction | None = None
        self.graphed_verify: GraphedFunction | None = None
        # cuda_graphs: True = capture on CUDA; "eager" = same static buffers and padding, re-executed (CPU-testable)
        if cuda_graphs == "eager" or (cuda_graphs and self.device.type == "cuda"):
            self._setup_cuda_graphs(max_batch, max_blocks_per_request, "eager" if cuda_graphs == "eager" else "cuda")

    def _setup_cuda_graphs(self, max_batch: int, width: int, mode: str) -> None:
        dev, h, rows_per_req = self.device, self.hidden_size, 1 + self.num_draft_tokens

        def i64(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=dev)

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=dev)

        def table() -> torch.Tensor:
            return torch.full((max_batch, width), -1, dtype=torch.int32, device=dev)

        def draft(hidden, token_ids, positions, counts, tables):
            return self.model.forward_draft(hidden, token_ids, positions, counts, tables, self.kv)

        self.graphed_draft = GraphedFunction(draft, {
            "hidden": (torch.zeros(max_batch, h, dtype=self.dtype, device=dev), 0),
            "token_ids": (i64(max_batch), 0),
            "positions": (i64(max_batch), 0),
            "counts": (i32(max_batch), 0),
            "block_tables": (table(), -1),
        }, lambda name, b: b, max_batch, mode)  # fmt: skip

        def verify(input_ids, positions, q_counts, kv_lens, tables):
            hidden = self.model.forward_main(input_ids, StepMeta(positions, q_counts, kv_lens, tables), self.kv)
            return hidden, self.model.compute_logits(hidden)

        per_token = {"input_ids", "positions"}
        self.graphed_verify = GraphedFunction(verify, {
            "input_ids": (i64(max_batch * rows_per_req), 0),
            "positions": (i64(max_batch * rows_per_req), 0),
            "q_counts": (i32(max_batch), 0),
            "kv_lens": (i32(max_batch), 0),
            "block_tables": (table(), -1),
        }, lambda name, b: b * rows_per_req if name in per_token else b, max_batch, mode)  # fmt: skip

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @torch.inference_mode()
    def run_main(self, inp: MainInput) -> MainOutput:
        if self.graphed_verify is not None and self._is_decode_only(inp):
            out = self.graphed_verify(len(inp.q_counts), {
                "input_ids": self._t(inp.input_ids), "positions": self._t(inp.positions),
                "q_counts": self._t(inp.q_counts), "kv_lens": self._t(inp.kv_lens),
                "block_tables": self._t(inp.block_tables),
            })  # fmt: skip
            if out is not None:
                n = len(inp.input_ids)
                return MainOutput(out[0][:n].float().cpu().numpy(), out[1][:n].float().cpu().numpy())
        meta = StepMeta(self._t(inp.positions), self._t(inp.q_counts), self._t(inp.kv_lens), self._t(inp.block_tables))
        if self.state is None:
            hidden = self.model.forward_main(self._t(inp.input_ids), meta, self.kv)
        else:  # hybrid: models/qwen3_next.py, whose main forward reads and writes the GDN state slots too
            assert isinstance(inp, HybridMainInput), "a hybrid model needs the state slots (runtime/core/state_pool.py)"
            cache = HybridCache(self.kv, self.state, self._t(inp.state_read_slots), self._t(inp.state_write_slots))
            hidden = cast(Any, self.model).forward_main(self._t(inp.input_ids), meta, cache)
        logits = self.model.compute_logits(hidden[self._t(inp.logit_rows)])
        return MainOutput(hidden.float().cpu().numpy(), logits.float().cpu().numpy())

    def _is_decode_only(self, inp: MainInput) -> bool:
        """Every request forwards exactly 1+k rows and every row's logits are wanted."""
        k1 = 1 + self.num_draft_tokens
        return bool((inp.q_counts == k1).all()) and np.array_equal(inp.logit_rows, np.arange(len(inp.input_ids)))

    @torch.inference_mode()
    def run_draft(self, inp: DraftInput) -> DraftOutput:
        module = draft_module(inp.depth, self.num_mtp_modules, self.mtp_modules)
        if self.graphed_draft is not None and module == 0:  # graphs are captured for module 0 only
            out = self.graphed_draft(len(inp.counts), {
                "hidden": self._t(inp.hidden_in).to(self.dtype), "token_ids": self._t(inp.token_ids),
                "positions": self._t(inp.positions), "counts": self._t(inp.counts),
                "block_tables": self._t(inp.block_tables),
            })  # fmt: skip
            if out is not None:
                n = len(inp.counts)
                return DraftOutput(out[0][:n].float().cpu().numpy(), out[1][:n].float().cpu().numpy())
        hidden, logits = self.model.forward_draft(
            self._t(inp.hidden_in).to(self.dtype), self._t(inp.token_ids), self._t(inp.positions),
            self._t(inp.counts), self._t(inp.block_tables), self.kv, mtp_index=module,
        )  # fmt: skip
        return DraftOutput(hidden.float().cpu().numpy(), logits.float().cpu().numpy())

    @torch.inference_mode()
    def run_commit(self, inp: CommitInput) -> int:
        written = self.model.forward_commit(
            self._t(inp.hidden_in).to(self.dtype), self._t(inp.token_ids), self._t(inp.counts),
            self._t(inp.starts), self._t(inp.block_tables), self.kv,
        )  # fmt: skip
        return int(written[0])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self.pool[:, :, dst] = self.pool[:, :, src]


def warn_spinning_threads() -> None:
    """One line when torch runs 2+ threads with spin-waiting OpenMP workers (10-100x slower steps measured
    on a shared machine, docs/PERFORMANCE.md). `import runtime` defaults OMP_WAIT_POLICY to PASSIVE."""
    if torch.get_num_threads() > 1 and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        print(f"mtp: warning: {torch.get_num_threads()} torch threads with spinning OpenMP waits; on a shared "
              "machine use 1 thread or set OMP_WAIT_POLICY=PASSIVE before starting", file=sys.stderr)  # fmt: skip
