"""GLM-4.5 / DeepSeek-V3-layout decoder with MTP modules, written over a paged KV pool.

The single source of truth for the math (HF reference: transformers `Glm4MoeForCausalLM` and its
`MtpLayer`). Tokens are *packed*: a step's rows from all requests are concatenated, described by
per-request counts. Every attention layer does exactly two KV calls, both plugin ops:
`mtp::kv_write` (append this step's K/V) and `mtp::paged_attention` (read). Swapping the KV backend
means swapping those two calls (see `PagedKV`).

Three entry points, one per engine graph (docs/ARCHITECTURE.md §6):
  forward_main   packed tokens -> post-final-norm hidden rows (main KV appended inside)
  forward_draft  one MTP depth for R requests: (hidden, token) -> (MTP hidden, logits); MTP KV written
  forward_commit packed (main hidden, next token) rows -> only the MTP attention's K/V written

Hidden-state convention (pinned by tests/models/test_hf_parity.py, written up in docs/MTP_HIDDEN_STATES.md):
the MTP module takes the main model's POST-final-norm hidden, and its output hidden after
`shared_head.norm` is both what the shared head projects and what the next depth chains.

Tensor parallelism (docs/ARCHITECTURE.md §8): every module takes the rank's `RankMapping`; shapes are local
(models/sharding.py decides the slices), and the partial sums are all-reduced once per block output
(attention output; MLP/MoE output), the vocab-parallel embedding once per lookup, the lm_head's logits
all-gathered along vocab. tp_size 1 emits no collective at all.

Shape names: T packed rows, R requests, H hidden, Hq/Hkv heads, D head dim, E experts, K top-k.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import plugins.collectives  # noqa: F401  (torch.ops.mtp.all_reduce / all_gather)
from models.config import ModelConfig, num_kv_planes
from models.dsa import DSAAttention
from models.feed_forward import MLP, MoE, fuse_linears, store_in_out
from models.layers import PagedKV, RMSNorm, StepMeta, vocab_parallel_embed, vocab_parallel_logits
from models.mla import MLAAttention
from models.sharding import head_split
from plugins.mapping import Parallel, RankMapping, rank_mapping
from plugins.rope import apply_rope


def default_mapping(cfg: ModelConfig, ep_size: int = 1, mapping: RankMapping | None = None) -> RankMapping:
    """`mapping`, or (callers that give only ep_size) a TP1 mapping whose local shapes are rank 0's."""
    return mapping or rank_mapping(0, Parallel(ep_size, ep_size, 1), cfg.n_routed_experts if cfg.has_moe else 0)


class Attention(nn.Module):
    """GQA attention; with TP this rank's q heads and the KV heads they use (models/sharding.py `head_split`)."""

    def __init__(self, cfg: ModelConfig, plane: int, mapping: RankMapping | None = None) -> None:
        super().__init__()
        self.plane = plane  # which KV plane of the pool this layer owns
        m = default_mapping(cfg, mapping=mapping)
        heads = head_split(cfg, m)
        self.tp_size = m.tp
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, cfg.head_dim
        self.rope_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused [q; k; v] weight, bias (fuse())

    def fuse(self) -> None:
        """Inference only: one [q; k; v] projection; q/k/v_proj become views of it (no extra memory)."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, not yet roped) and V: [T, Hkv, D]."""
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return k, v

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Roped q [T, Hq, D], roped k and v [T, Hkv, D] for packed rows at `positions` [T]."""
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self.project_kv(x)
        q = apply_rope(q, positions, self.rope_dim, self.rope_theta)
        k = apply_rope(k, positions, self.rope_dim, self.rope_theta)
        return q, k, v

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        q, k, v = self._project_qkv_fast(x, meta)
        written = kv.write(self.plane, k, v, meta.q_counts, meta.write_starts, meta.block_tables)
        out = kv.attend(self.plane, q, meta.q_counts, meta.kv_lens, meta.block_tables, written, self.scale)
        out = self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))
        return torch.ops.mtp.all_reduce(out, self.tp_size) if self.tp_size > 1 else out

    def _project_qkv_fast(self, x: torch.Tensor, meta: StepMeta):
        """project_qkv with the fused projection (after fuse()) and the forward's shared RoPE table."""
        rope = meta.rope(self.rope_dim, self.head_dim, self.rope_theta, x.dtype)
        hq, hkv = self.num_heads, self.num_kv_heads
        if self.qkv is None:
            q = self.q_proj(x).view(-1, hq, self.head_dim)
            k = self.k_proj(x).view(-1, hkv, self.head_dim)
            v = self.v_proj(x).view(-1, hkv, self.head_dim)
        else:
            qkv = F.linear(x, *self.qkv).view(-1, hq + 2 * hkv, self.head_dim)
            if self.q_norm is None and self.k_norm is None:  # rope q and k heads together
                qk = rope.apply(qkv[:, : hq + hkv])
                return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
            q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rope.apply(q), rope.apply(k), v

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        """Training path: x [B, S, H], causal self-attention over each sequence (no KV pool, autograd-able)."""
        b, s, _ = x.shape
        q, k, v = self.project_qkv(x.reshape(b * s, -1), torch.arange(s, device=x.device).repeat(b))
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def write_kv_only(self, x, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor:
        """The commit pass: K/V projections of x, K roped at its write position inside the plugin."""
        k, v = self.project_kv(x)
        return kv.write(self.plane, k, v, counts, starts, block_tables, self.rope_dim, self.rope_theta)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plane: int, is_moe: bool, ep_size: int = 1,
                 mapping: RankMapping | None = None) -> None:  # fmt: skip
        super().__init__()
        m = default_mapping(cfg, ep_size, mapping)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_mla:  # heads split over the TP group, the latent replicated (models/mla.py); DSA: one rank only
            self.self_attn: Attention | MLAAttention = (
                DSAAttention(cfg, plane) if cfg.is_dsa else MLAAttention(cfg, plane, m.tp)
            )
        else:
            self.self_attn = Attention(cfg, plane, m)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MoE(cfg, mapping=m) if is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, m.tp)

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_train(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + (self.mlp.forward_train(h) if isinstance(self.mlp, MoE) else self.mlp(h))


class MTPModule(nn.Module):
    """One MTP module: input = cat([enorm(emb(t_{p+1})), hnorm(h_p)]) (embedding first), a decoder block,
    then `final_norm` (checkpoint name `shared_head.norm`). The head/embedding are the main model's."""

    def __init__(self, cfg: ModelConfig, plane: int, ep_size: int = 1, mapping: RankMapping | None = None) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, plane, is_moe=cfg.has_moe, mapping=default_mapping(cfg, ep_size, mapping))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, token_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))


class Glm4MoeMTPModel(nn.Module):
    """Main decoder + lm_head + MTP modules. Planes: main layer i -> i, MTP module j -> num_hidden_layers + j."""

    def __init__(self, cfg: ModelConfig, ep_size: int = 1, mapping: RankMapping | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.mapping = m = default_mapping(cfg, ep_size, mapping)
        vocab = cfg.vocab_size // m.tp  # vocab-parallel: this rank's rows [vocab_lo, vocab_lo + vocab)
        self.vocab_lo = m.tp_rank * vocab
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, cfg.is_moe_layer(i), mapping=m) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.mtp = nn.ModuleList(
            [MTPModule(cfg, cfg.num_hidden_layers + j, mapping=m) for j in range(cfg.num_mtp_modules)]
        )

    @property
    def num_kv_planes(self) -> int:
        return num_kv_planes(self.cfg)  # a DSA model's indexer-key planes included

    def fuse(self) -> Glm4MoeMTPModel:
        """Inference layout: one QKV and one gate|up GEMM per block, every linear weight stored [in, out]
        (state_dict names, shapes and values unchanged; idempotent).

        Call after moving the model to its device: the fused tensors are plain attributes, not moved by .to().
        """
        for m in self.modules():
            # three checks, not one `or`: each narrows m for mypy (MLAAttention is not an Attention)
            if isinstance(m, Attention) and m.qkv is None or isinstance(m, MLP) and m.gate_up is None:  # noqa: SIM114
                m.fuse()
            elif isinstance(m, MLAAttention) and m.absorbed is None:
                m.fuse()
        for m in self.modules():
            if isinstance(m, nn.Linear):
                store_in_out(m)
        return self

    def forward_main(self, input_ids: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        """input_ids [T] -> post-final-norm hidden [T, H]. Appends K/V of every row to each layer's plane."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, meta, kv)  # DecoderLayer
        return self.norm(x)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, H]; with TP each rank looks up its vocab rows (others 0), then one all-reduce."""
        return vocab_parallel_embed(self.embed_tokens, token_ids, self.vocab_lo, self.mapping.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V]; with TP every rank computes its vocab slice and all ranks gather the full row."""
        return vocab_parallel_logits(self.lm_head, hidden, self.mapping.tp)

    def forward_draft(
        self,
        hidden: torch.Tensor,  # [R, H] main hidden at base-1 (depth 0) or previous depth's output
        token_ids: torch.Tensor,  # [R] base token (depth 0) or previous draft
        positions: torch.Tensor,  # [R] write position base-1+d
        counts: torch.Tensor,  # int32 [R] 1 = live request, 0 = padded row (writes and reads nothing)
        block_tables: torch.Tensor,  # int32 [R, max_blocks]
        kv: PagedKV,
        mtp_index: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft depth -> (chained hidden [R, H] after shared_head.norm, logits [R, V])."""
        module = cast(MTPModule, self.mtp[mtp_index])
        meta = StepMeta(positions.long(), counts, (positions.to(counts.dtype) + 1) * counts, block_tables)
        x = module.fuse(self.embed(token_ids), hidden)
        out = module.final_norm(module.block(x, meta, kv))
        return out, self.compute_logits(out)

    def forward_commit(
        self,
        hidden: torch.Tensor,  # [N, H] main hiddens h_p, packed by request
        token_ids: torch.Tensor,  # [N] the token at p+1 for each row (roll-by-one pairing)
        counts: torch.Tensor,  # int32 [R] one segment per active request (0 allowed)
        starts: torch.Tensor,  # int32 [R] position p of each segment's first row
        block_tables: torch.Tensor,
        kv: PagedKV,
        mtp_index: int = 0,
    ) -> torch.Tensor:
        """The commit pass: write the MTP plane's K/V for committed positions from main hiddens.

        Only the MTP attention's K/V projections run (K roped at its write position inside the plugin);
        the rest of the MTP block is not needed for these rows. Returns rows written (int64 [1]).
        """
        module = cast(MTPModule, self.mtp[mtp_index])
        x = module.block.input_layernorm(module.fuse(self.embed(token_ids), hidden))
        return module.block.self_attn.write_kv_only(x, counts, starts, block_tables, kv)

    def forward_train(self, input_ids: torch.Tensor, mtp_index: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training forward over full sequences input_ids [B, S] (dense causal attention, no KV pool).

        Returns main logits [B, S, V] (row p predicts t_{p+1}) and, when the model has an MTP module,
        MTP logits [B, S-1, V] (row p pairs h_p with t_{p+1} and predicts t_{p+2}): the DeepSeek-V3
        MTP objective at depth 1.
        """
        if self.mapping.tp > 1:
            raise ValueError("forward_train runs on one rank: build the model with tp_size 1 for training")
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = cast(DecoderLayer, layer).forward_train(x)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        if not len(self.mtp):
            return logits, None
        module = cast(MTPModule, self.mtp[mtp_index])
        m = module.fuse(self.embed_tokens(input_ids[:, 1:]), hidden[:, :-1])
        m = module.final_norm(module.block.forward_train(m))
        return logits, self.lm_head(m)
