"""PyTorch reference implementations: the one semantic definition of every plugin, and the test oracle.

Written for clarity, not speed: loops over requests and rows. Every other implementation (the CPU
torch op, the Triton kernels, the ONNX Runtime ops, the TensorRT plugins) must match these.
"""

from __future__ import annotations

import torch

from plugins.rope import apply_rope


def kv_write_ref(
    pool: torch.Tensor,  # [planes, 2, blocks, B, Hkv, D], written in place
    k: torch.Tensor,  # [T, Hkv, D] packed rows: request r's rows follow request r-1's
    v: torch.Tensor,  # [T, Hkv, D]
    counts: torch.Tensor,  # [R] rows of each request's segment (0 allowed)
    starts: torch.Tensor,  # [R] position of each segment's first row
    block_tables: torch.Tensor,  # [R, max_blocks] block ids, -1 = none
    plane: int,
    rope_dim: int = 0,  # > 0: rope K's first rope_dim dims at the write position before storing
    rope_theta: float = 10000.0,
) -> int:
    """Row j of request r goes to position starts[r]+j -> block table[r, pos // B], slot pos % B.

    Rows past sum(counts) are padding and ignored; a block id of -1 (or a position past the table) makes
    the row a no-op. Returns the number of rows actually stored.
    """
    block_size = pool.shape[3]
    written = 0
    row = 0
    for r in range(counts.shape[0]):
        for j in range(int(counts[r])):
            pos = int(starts[r]) + j
            col = pos // block_size
            if col < block_tables.shape[1] and int(block_tables[r, col]) >= 0:
                block, slot = int(block_tables[r, col]), pos % block_size
                key = k[row]
                if rope_dim > 0:
                    key = apply_rope(key[None].float(), torch.tensor([pos]), rope_dim, rope_theta)[0]
                pool[plane, 0, block, slot] = key.to(pool.dtype)
                pool[plane, 1, block, slot] = v[row].to(pool.dtype)
                written += 1
            row += 1
    return written


def paged_attention_ref(
    pool: torch.Tensor,  # [planes, 2, blocks, B, Hkv, D]
    q: torch.Tensor,  # [T, Hq, D] packed by request
    q_counts: torch.Tensor,  # [R] queries of each request (0 = padded request)
    kv_lens: torch.Tensor,  # [R] total KV length of each request, including these queries
    block_tables: torch.Tensor,  # [R, max_blocks]
    plane: int,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention: query j of request r sits at kv_lens[r]-q_counts[r]+j and sees 0..that.

    Rows past sum(q_counts) are padding and come back as zeros. Computed in fp32, returned in q's dtype.
    """
    block_size = pool.shape[3]
    num_q_heads, num_kv_heads = q.shape[1], pool.shape[4]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    row = 0
    for r in range(q_counts.shape[0]):
        n_q, n_kv = int(q_counts[r]), int(kv_lens[r])
        if n_q == 0:
            continue
        positions = torch.arange(n_kv)
        blocks = block_tables[r, positions // block_size].long()
        slots = positions % block_size
        keys = pool[plane, 0, blocks, slots].float()  # [n_kv, Hkv, D]
        values = pool[plane, 1, blocks, slots].float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = q[row : row + n_q].float()  # [n_q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = n_kv - n_q + torch.arange(n_q)
        mask = positions[None, :] > q_pos[:, None]  # [n_q, n_kv]
        scores = scores.masked_fill(mask[None], float("-inf"))
        out[row : row + n_q] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        row += n_q
    return out


def mla_kv_write_ref(
    pool: torch.Tensor,  # [planes, 1, blocks, B, 1, latent_dim] (kv_kind 1), written in place
    latent: torch.Tensor,  # [T, latent_dim] packed rows: [k_pe ; c_kv]
    counts: torch.Tensor,  # [R]
    starts: torch.Tensor,  # [R]
    block_tables: torch.Tensor,  # [R, max_blocks], -1 = none
    plane: int,
    inv_freq: torch.Tensor,  # float32 [rope_dim // 2]
    rope_dim: int = 0,  # > 0: rope latent[:, :rope_dim] at the write position before storing
    rope_scale: float = 1.0,  # YaRN attention factor multiplying cos and sin
) -> int:
    """kv_write_ref for one latent row per position: same segments, padding and no-op rules.

    The rope is written out per dim (not shared with the op): for i < rope_dim/2, angle = pos * inv_freq[i],
    out[i] = x[i] cos - x[i + h] sin and out[i + h] = x[i + h] cos + x[i] sin (h = rope_dim/2, neox
    rotate_half), with cos and sin multiplied by rope_scale. Returns the rows stored.
    """
    block_size = pool.shape[3]
    written = 0
    row = 0
    for r in range(counts.shape[0]):
        for j in range(int(counts[r])):
            pos = int(starts[r]) + j
            col = pos // block_size
            if col < block_tables.shape[1] and int(block_tables[r, col]) >= 0:
                x = latent[row].float().clone()
                half = rope_dim // 2
                for i in range(half):
                    angle = pos * inv_freq[i].float()
                    c, s = torch.cos(angle) * rope_scale, torch.sin(angle) * rope_scale
                    a, b = latent[row, i].float(), latent[row, i + half].float()
                    x[i], x[i + half] = a * c - b * s, b * c + a * s
                pool[plane, 0, int(block_tables[r, col]), pos % block_size, 0] = x.to(pool.dtype)
                written += 1
            row += 1
    return written


def mla_paged_attention_ref(
    pool: torch.Tensor,  # [planes, 1, blocks, B, 1, latent_dim]
    q: torch.Tensor,  # [T, H, latent_dim] absorbed queries [q_pe ; q_nope @ W_UK] packed by request
    q_counts: torch.Tensor,  # [R]
    kv_lens: torch.Tensor,  # [R]
    block_tables: torch.Tensor,  # [R, max_blocks]
    plane: int,
    rope_dim: int,  # values are latent[:, rope_dim:] (c_kv)
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA attention: keys = the whole latent, values = its c_kv part, causal as paged_attention_ref.

    Returns [T, H, latent_dim - rope_dim] in q's dtype (fp32 math); rows past sum(q_counts) are zeros.
    """
    block_size = pool.shape[3]
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] - rope_dim, dtype=q.dtype)
    row = 0
    for r in range(q_counts.shape[0]):
        n_q, n_kv = int(q_counts[r]), int(kv_lens[r])
        for j in range(n_q):
            q_pos = n_kv - n_q + j
            positions = torch.arange(q_pos + 1)
            blocks = block_tables[r, positions // block_size].long()
            latents = pool[plane, 0, blocks, positions % block_size, 0].float()  # [q_pos + 1, latent_dim]
            for h in range(q.shape[1]):
                weights = (latents @ q[row, h].float() * scale).softmax(0)
                out[row, h] = (weights @ latents[:, rope_dim:]).to(q.dtype)
            row += 1
    return out


def moe_experts_ref(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    w_gate_up: torch.Tensor,  # [E, 2*I, H]  (gate rows first, then up rows)
    w_down: torch.Tensor,  # [E, H, I]
    expert_offset: int = 0,  # global id of w_gate_up[0]; experts outside the local range contribute 0
) -> torch.Tensor:
    """sum_k w[t,k] * down(silu(gate(x_t)) * up(x_t)) over the token's experts held here."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    num_local = w_gate_up.shape[0]
    inter = w_gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot]) - expert_offset
            if not 0 <= e < num_local:
                continue
            gate_up = w_gate_up[e].float() @ x[t].float()
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, slot]) * (w_down[e].float() @ h)
    return out.to(x.dtype)


def gdn_step_ref(
    mixed: torch.Tensor,  # [T, C] packed in_proj rows (q, k, v channels, C = 2*Hk*Dk + Hv*Dv), before the conv
    b: torch.Tensor,  # [T, Hv] beta logits
    a: torch.Tensor,  # [T, Hv] decay logits
    q_counts: torch.Tensor,  # [R] rows of each request (0 = padded request: reads and writes nothing)
    starts: torch.Tensor,  # [R] position of each request's first row (0 = a fresh sequence: zero state)
    read_slots: torch.Tensor,  # [R] state slot each request starts from (ignored when starts == 0)
    write_slots: torch.Tensor,  # [T] slot that receives the state AFTER this row, -1 = not stored
    conv_pool: torch.Tensor,  # [S, C, K-1] conv windows (the last K-1 inputs), written in place
    ssm_pool: torch.Tensor,  # [S, Hv, Dk, Dv] fp32 recurrent states, written in place
    conv_weight: torch.Tensor,  # [C, K] depthwise causal conv
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> torch.Tensor:
    """One Gated DeltaNet layer's token mixing (Qwen3-Next / Qwen3.5), row by row -> core output [T, Hv, Dv] fp32.

    Per request: conv window = the slot's last K-1 inputs (zeros for a fresh sequence), out_t = silu(conv), split
    into q, k (l2-normalised, q scaled by Dk^-0.5) and v; with g_t = -exp(A_log) * softplus(a_t + dt_bias) and
    beta_t = sigmoid(b_t): S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t (transformers'
    `torch_recurrent_gated_delta_rule`). After row t the window and S go to write_slots[t] when it is >= 0: a
    verify step stores one state per row, so rollback to any accepted row is a slot choice (vLLM's design).
    """
    t_rows, c = mixed.shape
    hv, kk = a.shape[1], conv_weight.shape[1]
    kd, rep = num_k_heads * head_k_dim, hv // num_k_heads
    out = torch.zeros(t_rows, hv, head_v_dim, dtype=torch.float32)
    row0 = 0
    for r in range(q_counts.shape[0]):
        n = int(q_counts[r])
        if n == 0:
            continue
        fresh = int(starts[r]) == 0
        window = torch.zeros(c, kk - 1) if fresh else conv_pool[int(read_slots[r])].float().clone()
        state = torch.zeros(hv, head_k_dim, head_v_dim) if fresh else ssm_pool[int(read_slots[r])].float().clone()
        for t in range(row0, row0 + n):
            full = torch.cat([window, mixed[t].float()[:, None]], dim=1)  # [C, K]
            x = torch.nn.functional.silu((full * conv_weight.float()).sum(-1))
            window = full[:, 1:]
            q = x[:kd].view(num_k_heads, head_k_dim).repeat_interleave(rep, 0)
            k = x[kd : 2 * kd].view(num_k_heads, head_k_dim).repeat_interleave(rep, 0)
            v = x[2 * kd :].view(hv, head_v_dim)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * head_k_dim**-0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            g = -a_log.float().exp() * torch.nn.functional.softplus(a[t].float() + dt_bias.float())
            beta = b[t].float().sigmoid()
            state = state * g.exp()[:, None, None]
            delta = (v - (state * k[:, :, None]).sum(1)) * beta[:, None]  # [Hv, Dv]
            state = state + k[:, :, None] * delta[:, None, :]
            out[t] = (state * q[:, :, None]).sum(1)
            slot = int(write_slots[t])
            if slot >= 0:
                conv_pool[slot] = window.to(conv_pool.dtype)
                ssm_pool[slot] = state
        row0 += n
    return out


FP8_BLOCK = 128  # the FP8 releases' weight_block_size, both dims (DeepSeek-V3, GLM-4.5-FP8)


def dequantize_fp8_ref(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, or its uint8 bits
    scale_inv: torch.Tensor,  # [ceil(N/128), ceil(K/128)] float32, one per 128 x 128 block (edge blocks partial)
) -> torch.Tensor:
    """fp32(weight[n, k]) * scale_inv[n // 128, k // 128], one fp32 rounding per element (DeepSeek-V3's
    `weight_dequant`, transformers' finegrained_fp8). e4m3fn has no infinities; 0x7f / 0xff are NaN."""
    q = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return q.float() * s


def linear_fp8_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float32 @ dequantize_fp8_ref(weight [N, K] e4m3fn or its uint8 bits, scale_inv [ceil(N/128),
    ceil(K/128)] float32)^T + bias [N] in fp32 (mtp::linear_fp8's semantics)."""
    y = x.float() @ dequantize_fp8_ref(weight, scale_inv).T
    return y if bias is None else y + bias.float()


def dequantize_fp8_experts_ref(
    weight: torch.Tensor,  # [E, parts * R, C] float8_e4m3fn (or uint8 bits): parts stacked along the rows
    scale_inv: torch.Tensor,  # [E, parts * ceil(R/128), ceil(C/128)] float32
    parts: int = 1,  # 2 for w_gate_up: gate rows then up rows, each blocked on its own (as released, per expert)
) -> torch.Tensor:
    """float32 [E, parts * R, C]: every part of every expert dequantized with its own 128 x 128 block scales."""
    rows = weight.shape[1] // parts
    blocks = -(-rows // FP8_BLOCK)
    return torch.stack([
        torch.cat([dequantize_fp8_ref(weight[e, p * rows:(p + 1) * rows], scale_inv[e, p * blocks:(p + 1) * blocks])
                   for p in range(parts)])
        for e in range(weight.shape[0])
    ])  # fmt: skip


def moe_experts_fp8_ref(
    x: torch.Tensor,  # [T, H] float32
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    w_gate_up: torch.Tensor,  # [E, 2*I, H] float8_e4m3fn: gate rows, then up rows
    w_gate_up_scale: torch.Tensor,  # [E, 2*ceil(I/128), ceil(H/128)]: gate's block rows, then up's
    w_down: torch.Tensor,  # [E, H, I] float8_e4m3fn
    w_down_scale: torch.Tensor,  # [E, ceil(H/128), ceil(I/128)]
    expert_offset: int = 0,
) -> torch.Tensor:
    """moe_experts_ref over the dequantized experts (mtp::moe_experts_fp8's semantics)."""
    gate_up = dequantize_fp8_experts_ref(w_gate_up, w_gate_up_scale, parts=2)
    down = dequantize_fp8_experts_ref(w_down, w_down_scale)
    return moe_experts_ref(x, topk_ids, topk_weights, gate_up, down, expert_offset)


# Weight-only int8 (`mtp-build --quantize int8`, mtp::linear_int8, mtp::moe_experts_int8): symmetric, one fp32 scale per
# output channel (per row of each expert matrix). The quantizers live here, beside their dequantization, as the one
# definition of each format: the builder (builder/quantized_weights.py), the tests and the benches all use them.
INT8_MAX = 127  # symmetric: -128 is never produced, so q and -q are both representable


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., N, K], scale float32 [..., N]) with weight[..., n, :] ~ q[..., n, :] * scale[..., n]: one scale
    per row (a linear's output channel; for stacked experts [E, N, K], each expert's rows on their own), scale =
    max|row| / 127 (fp32), q = round(weight / scale) (half to even) clamped to [-127, 127]. An all-zero row gets
    scale 1 (q = 0: exactly 0 again, where scale 0 would give 0 / 0). The division is fp32, so an element of magnitude
    max|row| maps to +-127 exactly and every element's error is at most scale / 2 (plus fp32 rounding)."""
    w = weight.float()
    amax = w.abs().amax(dim=-1) if w.shape[-1] else torch.zeros(w.shape[:-1])
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8_ref(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32(weight[..., n, k]) * scale[..., n]: one fp32 rounding per element (weight [..., N, K] int8, scale
    [..., N] float32)."""
    return weight.float() * scale.float()[..., None]


def linear_int8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float32 @ dequantize_int8_ref(weight [N, K] int8, scale [N] float32)^T + bias [N] in fp32
    (mtp::linear_int8's semantics)."""
    y = x.float() @ dequantize_int8_ref(weight, scale).T
    return y if bias is None else y + bias.float()


# Group-wise weight-only int4 (mtp::linear_int4, mtp::moe_experts_int4): symmetric, one fp32 scale per group of
# `group_size` consecutive input features of a row (llama.cpp's Q4_0 idea: a scale per 32 weights follows local magnitude, where one per row at
# 4 bits would lose the small weights of a row with one large one). Values in [-7, 7] (INT4_MAX), as int8 leaves out
# -128: q and -q are both representable, so a group's largest magnitude maps to +-7 exactly whatever its sign, at the
# cost of one of the 16 codes (-8, which the kernel still reads). Packed two per byte, column 2i in the low nibble of
# byte i and 2i + 1 in the high one, each nibble the value's two's complement. 0.5 bytes per weight + 4 / group_size.
INT4_MAX = 7
INT4_GROUP = 32  # the reference's default group (llama.cpp's Q4_0 block); mtp-build's: builder/options.py INT4_GROUP_DEFAULT


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] from int values in [-8, 7] [..., K] (K even): byte i = (q[2i] & 15) | (q[2i+1] & 15) << 4."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: K = {q.shape[-1]} must be even (two int4 per byte)")
    nib = q.to(torch.int16) & 15
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., 2 * K/2] in [-8, 7] from pack_int4's bytes (the inverse)."""
    b = packed.to(torch.int16)
    nib = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K/2], scale float32 [..., N, K/group_size]) with weight[..., n, k] ~ q * scale[..., n,
    k // group_size]: per group scale = max|group| / 7 (fp32), q = round(weight / scale) (half to even) clamped to
    [-7, 7]; an all-zero group gets scale 1 (q = 0). group_size must be even and divide K (a one-line ValueError
    otherwise: the builder calls this with the user's choice)."""
    k = weight.shape[-1]
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"quantize_int4: group_size {group_size} must be a positive even divisor of K = {k} "
                         "(the input features of the weight)")  # fmt: skip
    w = weight.float().reshape(*weight.shape[:-1], k // group_size, group_size)
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp(-INT4_MAX, INT4_MAX).to(torch.int8).reshape(weight.shape)
    return pack_int4(q), scale.contiguous()


def dequantize_int4_ref(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32(q[..., n, k]) * scale[..., n, k // group_size]: one fp32 rounding per element (packed [..., N, K/2]
    uint8, scale [..., N, K/group_size] float32)."""
    q = unpack_int4(packed).float()
    return q * scale.float().repeat_interleave(group_size, dim=-1)


def linear_int4_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float32 @ dequantize_int4_ref(weight [N, K/2] uint8 (pack_int4), scale [N, K/group_size] float32,
    group_size)^T + bias [N] in fp32 (mtp::linear_int4's semantics)."""
    y = x.float() @ dequantize_int4_ref(weight, scale, group_size).T
    return y if bias is None else y + bias.float()


def moe_experts_int4_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                         w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
                         group_size: int, expert_offset: int = 0) -> torch.Tensor:  # fmt: skip
    """moe_experts_ref over the dequantized experts (mtp::moe_experts_int4's semantics): quantize_int4 of float experts
    [E, 2I, H] / [E, H, I] gives uint8 [E, 2I, H/2] / [E, H, I/2] and fp32 scales [E, 2I, H/G] / [E, H, I/G]."""
    gate_up = dequantize_int4_ref(w_gate_up, w_gate_up_scale, group_size)
    down = dequantize_int4_ref(w_down, w_down_scale, group_size)
    return moe_experts_ref(x, topk_ids, topk_weights, gate_up, down, expert_offset)


def moe_experts_int8_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                         w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
                         expert_offset: int = 0) -> torch.Tensor:  # fmt: skip
    """moe_experts_ref over the dequantized experts (mtp::moe_experts_int8's semantics): quantize_int8 of float experts
    [E, 2I, H] / [E, H, I] (gate rows, then up rows) gives int8 of those shapes and one fp32 scale per row, [E, 2I] /
    [E, H]."""
    gate_up, down = dequantize_int8_ref(w_gate_up, w_gate_up_scale), dequantize_int8_ref(w_down, w_down_scale)
    return moe_experts_ref(x, topk_ids, topk_weights, gate_up, down, expert_offset)
