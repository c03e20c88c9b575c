"""Qwen3-Next / Qwen3.5 (`qwen3_next`, `qwen3_5_moe_text`, `qwen3_5_moe`, `qwen3_5_text`, `qwen3_5`): a hybrid trunk
and its MTP module.

HF reference: transformers `Qwen3NextForCausalLM` / `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM` (main model), vLLM's
`qwen3_next_mtp.py` (the MTP module; transformers drops `mtp.*` on load). What differs from models/glm4_moe.py:
  * `layer_types`: "linear_attention" layers are Gated DeltaNet (models/gdn.py: recurrent state, no KV),
    "full_attention" layers are gated attention: q_proj emits [q ; gate] per head, zero-centred q/k RMSNorm,
    partial neox rope, output * sigmoid(gate) before o_proj. Only attention layers own a KV plane.
  * every RMSNorm but the GDN output norm is zero-centred: the scale is 1 + w (`ZeroCentredRMSNorm`);
  * the FFN is MoE with softmax top-k routing (renormalised) and ONE shared expert scaled by
    sigmoid(shared_expert_gate(x)); dense Qwen3.5 (`qwen3_5_text`, `qwen3_5`) has a SwiGLU MLP instead;
  * the MTP module (`mtp.*`): fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)]) (embedding first),
    one full-attention MoE decoder layer (`mtp.layers.0`), `mtp.norm`, the main embedding and lm_head; h is the
    main model's post-final-norm hidden and the chained hidden is the post-`mtp.norm` output (as vLLM).
The main forward takes a `HybridCache` (paged KV + GDN state slots); the draft and commit passes take only the
paged KV: the MTP layer is full attention and needs no recurrent state (tests/models/test_hybrid_parity.py).

Tensor parallelism follows models/glm4_moe.py (models/sharding.py decides the slices): attention heads, GDN key heads
with their value heads (models/gdn.py), the shared expert / dense MLP columns, the routed experts over the TP group and
the vocab split; one all-reduce per block output, the embedding's once per lookup, the logits all-gathered.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.feed_forward import MLP
from models.gdn import GatedDeltaNet, HybridCache
from models.layers import PagedKV, RMSNorm, StepMeta, row_parallel, vocab_parallel_embed, vocab_parallel_logits
from models.sharding import head_split
from plugins.mapping import Parallel, RankMapping, rank_mapping


class ZeroCentredRMSNorm(RMSNorm):
    """rmsnorm(x) * (1 + w) in fp32 (weights stored zero-centred: a zero weight is the identity scale)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Qwen3-Next full attention over the paged KV pool: gated output, zero-centred q/k norms, partial rope."""

    def __init__(self, cfg: ModelConfig, plane: int, mapping: RankMapping) -> None:
        super().__init__()
        self.plane, self.tp_size = plane, mapping.tp
        heads = head_split(cfg, mapping)  # this rank's q heads and the KV heads they use
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, cfg.head_dim
        self.rope_dim, self.rope_theta, self.scale = cfg.rotary_dim, cfg.rope_theta, cfg.head_dim**-0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, 2 * self.num_heads * self.head_dim, bias=bias)  # per head [q ; gate]
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        return k, self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        q, gate = self.q_proj(x).view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k, v = self.project_kv(x)
        rope = meta.rope(self.rope_dim, self.head_dim, self.rope_theta, x.dtype)
        q, k = rope.apply(self.q_norm(q)), rope.apply(k)
        written = kv.write(self.plane, k, v, meta.q_counts, meta.write_starts, meta.block_tables)
        out = kv.attend(self.plane, q.contiguous(), meta.q_counts, meta.kv_lens, meta.block_tables, written, self.scale)
        out = out.reshape(-1, self.num_heads * self.head_dim) * torch.sigmoid(gate.reshape(x.shape[0], -1))
        return row_parallel(self.o_proj, out, self.tp_size)

    def write_kv_only(self, x, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor:
        """The commit pass: K (normed; roped at its position inside the plugin) and V of x."""
        k, v = self.project_kv(x)
        return kv.write(self.plane, k, v, counts, starts, block_tables, self.rope_dim, self.rope_theta)


class SparseMoE(nn.Module):
    """Softmax top-k routed experts (`mtp::moe_experts`, the fused canonical layout) + a sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, mapping: RankMapping) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.ep_size = cfg.n_routed_experts, cfg.num_experts_per_tok, mapping.ep
        self.tp_size, self.tp_rank = mapping.tp, mapping.tp_rank
        self.norm_topk_prob = cfg.norm_topk_prob
        inter, local = cfg.moe_intermediate_size, cfg.n_routed_experts // mapping.ep
        self.gate = nn.Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.zeros(local, 2 * inter, cfg.hidden_size))  # gate rows, then up rows
        self.w_down = nn.Parameter(torch.zeros(local, cfg.hidden_size, inter))
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, mapping.tp, reduce=False)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        args = (x, ids, weights, self.w_gate_up, self.w_down, self.num_experts, self.ep_size)
        tp_args = (self.tp_size, self.tp_rank) if self.tp_size > 1 else ()  # the TP1 graph keeps its node as it was
        out = torch.ops.mtp.moe_experts(*args, *tp_args)
        # the gate is a per-row scalar, the same on every rank: the partial shared outputs sum to the gated whole
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return torch.ops.mtp.all_reduce(out, self.tp_size) if self.tp_size > 1 else out


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block: GDN (`linear_attn`) or gated attention (`self_attn`), then the MoE."""

    def __init__(self, cfg: ModelConfig, kind: str, index: int, mapping: RankMapping) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_gdn = kind == "linear_attention"
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg, index, mapping.tp)  # index: the layer of the GDN state pool
        else:
            self.self_attn = GatedAttention(cfg, index, mapping)  # index: the KV plane
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoE(cfg, mapping) if cfg.has_moe else
                               MLP(cfg.hidden_size, cfg.intermediate_size, mapping.tp))  # fmt: skip

    def forward(self, x: torch.Tensor, meta: StepMeta, cache: HybridCache | PagedKV) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_gdn:
            x = x + self.linear_attn(h, meta, cast(HybridCache, cache))
        else:
            x = x + self.self_attn(h, meta, cache.kv if isinstance(cache, HybridCache) else cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextMTPModule(nn.Module):
    """`mtp.*`: fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)]) -> a full-attention layer (MoE or dense, as
    the trunk) -> norm."""

    def __init__(self, cfg: ModelConfig, plane: int, mapping: RankMapping) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.block = HybridDecoderLayer(cfg, "full_attention", plane, mapping)
        self.norm = ZeroCentredRMSNorm(h, eps)

    def fuse(self, token_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(token_emb), self.pre_fc_norm_hidden(hidden)], dim=-1))


class Qwen3NextMTPModel(nn.Module):
    """Hybrid main model + lm_head + MTP module, with Glm4MoeMTPModel's three entry points.

    KV planes: the i-th full-attention main layer -> plane i, MTP module j -> plane (attention layers) + j.
    GDN state: the g-th GDN layer -> layer g of the state pool."""

    def __init__(self, cfg: ModelConfig, ep_size: int = 1, mapping: RankMapping | None = None) -> None:
        super().__init__()
        m = mapping or rank_mapping(0, Parallel(ep_size, ep_size, 1), cfg.n_routed_experts)
        self.cfg, self.mapping = cfg, m
        vocab = cfg.vocab_size // m.tp  # vocab-parallel: this rank's rows [vocab_lo, vocab_lo + vocab)
        self.vocab_lo = m.tp_rank * vocab
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        index = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for kind in cfg.layer_types:
            layers.append(HybridDecoderLayer(cfg, kind, index[kind], m))
            index[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.num_attention_layers = index["full_attention"]
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.mtp = nn.ModuleList(
            [Qwen3NextMTPModule(cfg, self.num_attention_layers + j, m) for j in range(cfg.num_mtp_modules)]
        )

    @property
    def num_kv_planes(self) -> int:
        return self.num_attention_layers + self.cfg.num_mtp_modules

    def fuse(self) -> Qwen3NextMTPModel:
        """Inference layout (idempotent): the shared experts' gate|up as one GEMM."""
        for mod in self.modules():
            if isinstance(mod, MLP) and mod.gate_up is None:
                mod.fuse()
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(self.embed_tokens, token_ids, self.vocab_lo, self.mapping.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.lm_head, hidden, self.mapping.tp)

    def forward_main(self, input_ids: torch.Tensor, meta: StepMeta, cache: HybridCache) -> torch.Tensor:
        """input_ids [T] -> post-final-norm hidden [T, H]; attention K/V appended, GDN states read/written."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, meta, cache)
        return self.norm(x)

    def forward_draft(self, hidden, token_ids, positions, counts, block_tables, kv: PagedKV,
                      mtp_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One draft depth -> (chained hidden after mtp.norm [R, H], logits [R, V]); no GDN state involved."""
        module = cast(Qwen3NextMTPModule, self.mtp[mtp_index])
        meta = StepMeta(positions.long(), counts, (positions.to(counts.dtype) + 1) * counts, block_tables)
        out = module.norm(module.block(module.fuse(self.embed(token_ids), hidden), meta, kv))
        return out, self.compute_logits(out)

    def forward_commit(self, hidden, token_ids, counts, starts, block_tables, kv: PagedKV,
                       mtp_index: int = 0) -> torch.Tensor:  # fmt: skip
        """The commit pass: the MTP attention's K/V for committed (h_p, t_{p+1}) rows; returns rows written."""
        module = cast(Qwen3NextMTPModule, self.mtp[mtp_index])
        x = module.block.input_layernorm(module.fuse(self.embed(token_ids), hidden))
        return module.block.self_attn.write_kv_only(x, counts, starts, block_tables, kv)
