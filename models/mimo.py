"""MiMo (`MiMoForCausalLM`, `model_type: mimo`): a dense Qwen2 trunk with MTP layers `model.mtp_layers.{i}.*`.

The trunk is models/glm4_moe.py's decoder as it is (q/k/v bias, full rotary, dense SwiGLU MLP in every layer:
`ModelConfig.from_hf_dict` sets those fields for mimo). What differs is the MTP module's wiring, as vLLM's
`mimo.py` / `mimo_mtp.py` (written by Xiaomi) run it:
  * the MTP input is cat([hidden_layernorm(h), token_layernorm(emb)]): HIDDEN FIRST (`MiMoMTPModule.fuse`; the
    canonical names are GLM's: hidden_layernorm -> hnorm, token_layernorm -> enorm, input_proj -> eh_proj);
  * h is the main model's hidden BEFORE the final norm (vLLM's `MiMoModel.forward` returns it and
    `MiMoForCausalLM.compute_logits` applies `model.norm`), so `forward_main` here returns the pre-norm hidden and
    `compute_logits` (main rows) applies the norm; draft logits project the MTP output (after its
    `final_layernorm`) directly, and that output is also what a further depth would chain.
vLLM also zeroes the token embedding of the MTP row at position 0; we do not (one draft-KV entry of the prompt's
first position differs; drafts only, never the output: docs/MODELS.md).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from models.config import ModelConfig
from models.glm4_moe import DecoderLayer, Glm4MoeMTPModel, MTPModule
from models.layers import PagedKV, StepMeta
from plugins.mapping import RankMapping


class MiMoMTPModule(MTPModule):
    """MiMo's MTP layer: the same parts as GLM's, concatenated hidden first."""

    def fuse(self, token_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(token_emb)], dim=-1))


class MiMoMTPModel(Glm4MoeMTPModel):
    """Glm4MoeMTPModel with MiMo's MTP layer and hidden convention: main hidden rows are pre-final-norm."""

    def __init__(self, cfg: ModelConfig, ep_size: int = 1, mapping: RankMapping | None = None) -> None:
        super().__init__(cfg, ep_size, mapping)
        self.mtp = nn.ModuleList(
            [MiMoMTPModule(cfg, cfg.num_hidden_layers + j, mapping=self.mapping) for j in range(cfg.num_mtp_modules)]
        )

    def forward_main(self, input_ids: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        """input_ids [T] -> PRE-final-norm hidden [T, H] (what MiMo's MTP takes); K/V appended as in GLM."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, meta, kv)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Main-model logits of pre-norm hidden rows: the final norm, then the head."""
        return self.project(self.norm(hidden))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden)

    def forward_draft(self, hidden, token_ids, positions, counts, block_tables, kv: PagedKV,
                      mtp_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One draft depth -> (MTP output after final_layernorm [R, H], logits [R, V]); no main norm on top."""
        module = cast(MTPModule, self.mtp[mtp_index])
        meta = StepMeta(positions.long(), counts, (positions.to(counts.dtype) + 1) * counts, block_tables)
        out = module.final_norm(module.block(module.fuse(self.embed(token_ids), hidden), meta, kv))
        return out, self.project(out)

    def forward_train(self, input_ids: torch.Tensor, mtp_index: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense causal training forward: main logits [B, S, V] and MTP depth-1 logits [B, S-1, V]."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = cast(DecoderLayer, layer).forward_train(x)
        logits = self.lm_head(self.norm(x))
        if not len(self.mtp):
            return logits, None
        module = cast(MTPModule, self.mtp[mtp_index])
        m = module.fuse(self.embed_tokens(input_ids[:, 1:]), x[:, :-1])
        return logits, self.lm_head(module.final_norm(module.block.forward_train(m)))
