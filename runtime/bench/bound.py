"""The memory-bandwidth bound of a decode step: weight bytes one forward must read / DRAM bandwidth.

Decoding a small batch is memory-bound on any real model: every forward streams the weights it touches
from memory once, so bytes touched / bandwidth is the fastest a step can be on this machine, whatever the
engine. The bench prints it beside each measured step time so the gap (per-call overhead, dispatch,
Python) is visible. Pure functions of the model config; nothing here runs or times a model.

Counted per forward: every attention and norm weight of each layer it runs, the dense MLP of the first
`first_k_dense_replace` layers, per MoE layer the router, the shared experts and the routed experts the
tokens select, the final norm and the full lm_head, plus one embedding row per token. Routed experts:
with T tokens in the forward, the expected number of distinct experts under uniform top-k routing,
E * (1 - (1 - k/E)^T) (exactly k for one token). A step with K > 0 drafts is one main forward over
B * (1 + K) tokens plus K + 1 MTP-module forwards (K serial draft depths and the commit pass that
refreshes the MTP plane; llama.cpp and transformers run the MTP module the same number of times).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig

DRAM_BYTES_PER_SECOND = 25e9  # a typical single-socket DDR4/DDR5 server channel set; override with --dram-gbps


@dataclass
class ForwardBytes:
    main: float  # one main-model forward over `tokens` tokens
    mtp: float  # one MTP-module forward over `tokens` tokens (0 without an MTP module)
    tokens: int


def _attention_params(c: ModelConfig) -> int:
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    p = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 2 * c.hidden_size  # q,k,v,o + the two RMSNorms
    p += (q + 2 * kv) if c.attention_bias else 0
    p += 2 * c.head_dim if c.use_qk_norm else 0
    return p


def expected_experts(c: ModelConfig, tokens: int) -> float:
    """Distinct routed experts touched by `tokens` tokens under uniform top-k routing (k for one token)."""
    e, k = c.n_routed_experts, c.num_experts_per_tok
    if e == 0 or k == 0:
        return 0.0
    return e * (1.0 - (1.0 - k / e) ** tokens)


def _moe_params(c: ModelConfig, tokens: int) -> float:
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    router = c.hidden_size * c.n_routed_experts + c.n_routed_experts  # gate weight + e_score_correction_bias
    return router + c.n_shared_experts * expert + expected_experts(c, tokens) * expert


def forward_params(c: ModelConfig, tokens: int) -> ForwardBytes:
    """Parameters (not bytes) touched by one main forward and one MTP forward over `tokens` tokens."""
    head = c.hidden_size + c.vocab_size * c.hidden_size  # final norm + lm_head (shared by the MTP module)
    emb = tokens * c.hidden_size
    main = float(emb + head)
    for layer in range(c.num_hidden_layers):
        main += _attention_params(c)
        main += _moe_params(c, tokens) if c.is_moe_layer(layer) else 3 * c.hidden_size * c.intermediate_size
    mtp = 0.0
    if c.num_mtp_modules:
        mlp = _moe_params(c, tokens) if c.has_moe else 3 * c.hidden_size * c.intermediate_size
        mtp = emb + 2 * c.hidden_size + 2 * c.hidden_size * c.hidden_size + _attention_params(c) + mlp + head
    return ForwardBytes(main, mtp, tokens)


def step_bound_seconds(c: ModelConfig, k: int, batch: int, bytes_per_param: float = 4.0,
                       bandwidth: float = DRAM_BYTES_PER_SECOND) -> float:  # fmt: skip
    """Lower bound on one decode step: main forward over batch*(1+k) tokens + (k+1) MTP forwards when k > 0."""
    main = forward_params(c, batch * (1 + k)).main
    mtp = (k + 1) * forward_params(c, batch).mtp if k > 0 else 0.0
    return (main + mtp) * bytes_per_param / bandwidth


def bound_summary(c: ModelConfig, bytes_per_param: float = 4.0, bandwidth: float = DRAM_BYTES_PER_SECOND) -> dict:
    """The per-forward numbers bench.json records (batch-1 decode: one token per forward)."""
    one = forward_params(c, 1)
    return {
        "bytes_per_param": bytes_per_param,
        "dram_bytes_per_second": bandwidth,
        "main_forward_bytes": round(one.main * bytes_per_param),
        "mtp_forward_bytes": round(one.mtp * bytes_per_param),
        "main_forward_bound_ms": round(one.main * bytes_per_param / bandwidth * 1e3, 5),
        "mtp_forward_bound_ms": round(one.mtp * bytes_per_param / bandwidth * 1e3, 5),
    }
