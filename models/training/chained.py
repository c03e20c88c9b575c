"""The chained-depth MTP training forward: depths 1..K of ONE MTP module, each depth fed exactly what the
runtime's serial draft loop feeds it.

What the runtime does (runtime/core/mtp_plan.py, docs/MTP_HIDDEN_STATES.md): the MTP plane holds, at every
committed position q, the K/V of the depth-1 entry (h_q, t_{q+1}) written by the commit pass from the main
model's post-final-norm hidden h_q. Drafting from base position b, depth 1 writes position b-1 from
(h_{b-1}, t_b); depth j writes position b-2+j from (g_{j-1}, token), where g_{j-1} is depth j-1's output AFTER
`shared_head.norm` and the token is depth j-1's draft (the true next token whenever that draft is accepted).

So, teacher-forced over a window, chain row p (base b = p+1) at depth j:
    input  (g^{j-1}_p, t_{p+j}) with g^0_p = h_p,   roped at position p+j-1,   target t_{p+j+1};
    keys   the depth-1 entries of positions 0..p (causal) + this row's own chain entries of depths 2..j.
Depth 1 is therefore the usual DeepSeek-V3 MTP row (`Glm4MoeMTPModel.forward_train`), and depth j > 1 sees
precisely the KV history and hidden the draft loop would give it (tests/models/test_chained_mtp.py checks this
against `forward_draft` over a real paged KV pool). Gradients flow through the whole chain.

Only public pieces of models/glm4_moe.py are used (the MTP module's fuse / block / final_norm, the attention's
project_qkv / o_proj, the MLP's forward_train): that file stays the single source of truth for the math.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from models.feed_forward import MLP, MoE
from models.glm4_moe import Attention, DecoderLayer, Glm4MoeMTPModel, MTPModule


def _mlp(block: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    h = block.post_attention_layernorm(x)
    return x + (block.mlp.forward_train(h) if isinstance(block.mlp, MoE) else cast(MLP, block.mlp)(h))


def _project(block: DecoderLayer, x: torch.Tensor, first_position: int) -> tuple[torch.Tensor, ...]:
    """Roped q, k and v [B, heads, n, D] of rows x [B, n, H] whose row p sits at position first_position + p."""
    attn = block.self_attn
    assert isinstance(attn, Attention), "chained MTP training covers GQA (glm4_moe) attention only"
    b, n, _ = x.shape
    pos = torch.arange(first_position, first_position + n, device=x.device).repeat(b)
    q, k, v = attn.project_qkv(block.input_layernorm(x).reshape(b * n, -1), pos)
    return tuple(t.view(b, n, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))


def chain_mask(n_rows: int, n_base: int, depth: int, device=None) -> torch.Tensor:
    """bool [n_rows, n_base + (depth-1)*n_rows]: row p sees base keys 0..p and key p of each chain block."""
    p = torch.arange(n_rows, device=device)
    base = torch.arange(n_base, device=device)[None, :] <= p[:, None]
    diag = torch.eye(n_rows, dtype=torch.bool, device=device)
    return torch.cat([base] + [diag] * (depth - 1), dim=1)


def chained_forward(
    model: Glm4MoeMTPModel, input_ids: torch.Tensor, depths: int, mtp_index: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """input_ids [B, S] -> (main logits [B, S, V], [MTP logits of depth j: [B, S-j, V] for j = 1..depths]).

    Depth j row p predicts t_{p+j+1}; its logits are the shared lm_head of the post-`shared_head.norm`
    hidden, which is also what depth j+1 consumes.
    """
    s = input_ids.shape[1]
    if not 1 <= depths <= s - 1:
        raise ValueError(f"depths={depths} must be in 1..{s - 1} for windows of {s} input tokens")
    x = model.embed_tokens(input_ids)
    for layer in model.layers:
        x = cast(DecoderLayer, layer).forward_train(x)
    hidden = model.norm(x)
    main_logits = model.lm_head(hidden)
    module = cast(MTPModule, model.mtp[mtp_index])
    block, attn = module.block, module.block.self_attn
    emb = model.embed_tokens(input_ids)

    # Depth 1: rows p = 0..S-2, (h_p, t_{p+1}) at position p; plain causal attention over themselves.
    x1 = module.fuse(emb[:, 1:], hidden[:, :-1])
    q, k1, v1 = _project(block, x1, 0)
    out = F.scaled_dot_product_attention(q, k1, v1, is_causal=True, scale=attn.scale, enable_gqa=True)
    g = module.final_norm(_mlp(block, x1 + attn.o_proj(out.transpose(1, 2).flatten(2))))
    mtp_logits = [model.lm_head(g)]
    chain_k: list[torch.Tensor] = []
    chain_v: list[torch.Tensor] = []
    for j in range(2, depths + 1):
        n = s - j  # rows p = 0..S-j-1 still have a target t_{p+j+1} inside the window
        xj = module.fuse(emb[:, j : j + n], g[:, :n])  # (g^{j-1}_p, t_{p+j})
        q, kj, vj = _project(block, xj, j - 1)
        chain_k.append(kj)
        chain_v.append(vj)
        keys = torch.cat([k1] + [c[:, :, :n] for c in chain_k], dim=2)
        values = torch.cat([v1] + [c[:, :, :n] for c in chain_v], dim=2)
        mask = chain_mask(n, k1.shape[2], j, device=input_ids.device)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale, enable_gqa=True)
        g = module.final_norm(_mlp(block, xj + attn.o_proj(out.transpose(1, 2).flatten(2))))
        mtp_logits.append(model.lm_head(g))
    return main_logits, mtp_logits


def chained_losses(
    model: Glm4MoeMTPModel, window: torch.Tensor, depths: int
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """window [B, S+1] -> (main CE, [CE of depth j], main logits, [depth-j logits]); depth j targets t_{p+j+1}."""
    main_logits, mtp_logits = chained_forward(model, window[:, :-1], depths)
    vocab = main_logits.shape[-1]
    main_ce = F.cross_entropy(main_logits.reshape(-1, vocab).float(), window[:, 1:].reshape(-1))
    ces = [
        F.cross_entropy(lg.reshape(-1, vocab).float(), window[:, j + 1 :].reshape(-1))
        for j, lg in enumerate(mtp_logits, start=1)
    ]
    return main_ce, ces, main_logits, mtp_logits


def chain_matches(main_logits: torch.Tensor, mtp_logits: list[torch.Tensor]) -> torch.Tensor:
    """bool [depths, B, S-depths]: depth-j draft of row p == the main model's greedy token at row p+j.

    Both predict t_{p+j+1}; equality is what greedy speculative decoding accepts at draft position j.
    Rows are truncated to those every depth has, so AND over depths gives chained (unconditional) acceptance.
    """
    depths = len(mtp_logits)
    n = main_logits.shape[1] - depths
    target = main_logits.argmax(-1)
    return torch.stack([lg[:, :n].argmax(-1) == target[:, j : j + n] for j, lg in enumerate(mtp_logits, start=1)])
