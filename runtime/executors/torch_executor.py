"""The `torch` executor: runs models/glm4_moe.py directly over a KV pool it allocates once.

On CPU this is the reference executor for the runtime tests. (CUDA graphs per batch bucket are the
GPU path; see runtime/executors/README.md for what is and is not exercised here.)
"""

from __future__ import annotations

import numpy as np
import torch

from models.glm4_moe import Glm4MoeMTPModel, PagedKV, StepMeta
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from runtime.executors.base import CommitInput, DraftInput, DraftOutput, MainInput, MainOutput


class TorchExecutor:
    def __init__(self, model: Glm4MoeMTPModel, num_blocks: int, block_size: int, device: str = "cpu") -> None:
        cfg = model.cfg
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.geom = KVPoolGeometry(
            model.num_kv_planes, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
            {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[self.dtype],
        )  # fmt: skip
        self.pool = allocate_pool(self.geom, self.device)
        self.kv = PagedKV(pool_address(self.pool), self.geom)
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @torch.inference_mode()
    def run_main(self, inp: MainInput) -> MainOutput:
        meta = StepMeta(self._t(inp.positions), self._t(inp.q_counts), self._t(inp.kv_lens), self._t(inp.block_tables))
        hidden = self.model.forward_main(self._t(inp.input_ids), meta, self.kv)
        logits = self.model.compute_logits(hidden[self._t(inp.logit_rows)])
        return MainOutput(hidden.float().cpu().numpy(), logits.float().cpu().numpy())

    @torch.inference_mode()
    def run_draft(self, inp: DraftInput) -> DraftOutput:
        hidden, logits = self.model.forward_draft(
            self._t(inp.hidden).to(self.dtype), self._t(inp.token_ids), self._t(inp.positions),
            self._t(inp.counts), self._t(inp.block_tables), self.kv,
        )  # fmt: skip
        return DraftOutput(hidden.float().cpu().numpy(), logits.float().cpu().numpy())

    @torch.inference_mode()
    def run_commit(self, inp: CommitInput) -> int:
        written = self.model.forward_commit(
            self._t(inp.hidden).to(self.dtype), self._t(inp.token_ids), self._t(inp.counts),
            self._t(inp.starts), self._t(inp.block_tables), self.kv,
        )  # fmt: skip
        return int(written[0])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self.pool[:, :, dst] = self.pool[:, :, src]
