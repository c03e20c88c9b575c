"""Rotary position embedding, neox style (rotate_half) over the first `rope_dim` dims of each head.

This is the convention of Hugging Face Glm4Moe (`apply_rotary_pos_emb` with partial rotary) and of
DeepSeek-V3 / GLM-4.7-Flash MLA once the importer has de-interleaved the rope rows of the projections
(models/checkpoint.py `deinterleave_rope_rows`). The model and the KV-write plugins (which can rope K at
its write position for the MTP commit pass) share it.

A rope is described by `inv_freq` (float32 [rope_dim/2]) and `scale` (YaRN's attention factor, which
multiplies cos and sin; 1.0 without scaling): `rope_parameters` computes both for the default and the YaRN
rope exactly as transformers' `_compute_default_rope_parameters` / `_compute_yarn_parameters`, and
`yarn_softmax_scale` is the softmax-scale correction of DeepSeek attention (HF `yarn_apply_mscale`).
`rope_table` / `rope_table_freq` are the fast form the model uses: cos/sin built once per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def default_inv_freq(rope_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """1 / theta^(2i/rope_dim), float32 [rope_dim/2] (HF's default rope)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.int64, device=device).float() / rope_dim
    return 1.0 / (theta**exponents)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(
    rope_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    original_max_position_embeddings: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float = 0.0,
    mscale_all_dim: float = 0.0,
    attention_factor: float = 0.0,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rope_dim/2] on CPU, attention_factor) for a default or YaRN rope.

    YaRN blends interpolated (1/(factor*theta^x)) and extrapolated (1/theta^x) frequencies with a linear
    ramp over the dims between the beta_fast and beta_slow correction dims; `attention_factor` (0 = derive)
    scales cos and sin. Mirrors transformers' `_compute_yarn_parameters` operation for operation.
    """
    if rope_type == "default":
        return default_inv_freq(rope_dim, theta), 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, yarn")
    if not attention_factor:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = beta_fast or 32, beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2).to(dtype=torch.float) / rope_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(head_dim: int, rope_type: str, factor: float, mscale_all_dim: float) -> float:
    """head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 for a scaled rope with mscale_all_dim set."""
    scale = head_dim**-0.5
    if rope_type != "default" and mscale_all_dim:
        m = yarn_get_mscale(factor, mscale_all_dim)
        scale = scale * m * m
    return scale


def freq_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, 2 * len(inv_freq)] (frequencies duplicated, neox), times `scale`; fp32 like HF."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, rope_dim] for int positions [T] (computed in fp32, like HF)."""
    return freq_cos_sin(positions, default_inv_freq(rope_dim, theta, positions.device))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rope_dim], x[..., rope_dim:]
    half = rope_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates x[..., :rope_dim] at `positions` [T]; the rest passes through."""
    cos, sin = rope_cos_sin(positions, rope_dim, theta)
    return _rotate(x, cos, sin, rope_dim)


def apply_rope_freq(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """apply_rope for a rope given by inv_freq [rope_dim/2] and scale (YaRN); x [T, heads, head_dim]."""
    cos, sin = freq_cos_sin(positions, inv_freq, scale)
    return _rotate(x, cos, sin, 2 * inv_freq.shape[0])


@dataclass(frozen=True, slots=True)
class RopeTable:
    """apply_rope as three elementwise ops over the whole head, for positions computed once per forward.

    x * cos + x[..., perm] * sin equals apply_rope bit for bit: pass-through dims have cos 1 and sin 0, and
    rotate_half's negation is folded into the sign of sin (IEEE negation is exact).
    """

    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim] signed
    perm: torch.Tensor  # int64 [head_dim]: rotate_half's swap on the rope dims, identity on the rest

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> roped copy."""
        return x * self.cos + x.index_select(-1, self.perm) * self.sin


def rope_table(positions: torch.Tensor, rope_dim: int, head_dim: int, theta: float, dtype: torch.dtype) -> RopeTable:
    cos, sin = rope_cos_sin(positions, rope_dim, theta)
    return _table(cos, sin, rope_dim, head_dim, dtype)


def rope_table_freq(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, head_dim: int, dtype: torch.dtype
) -> RopeTable:
    """rope_table for a rope given by inv_freq and scale (MLA: head_dim = rope_dim, the whole k_pe / q_pe)."""
    cos, sin = freq_cos_sin(positions, inv_freq, scale)
    return _table(cos, sin, 2 * inv_freq.shape[0], head_dim, dtype)


def _table(cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, head_dim: int, dtype: torch.dtype) -> RopeTable:
    half, rest = rope_dim // 2, head_dim - rope_dim
    t = cos.shape[0]
    dev = cos.device
    cos_full = torch.cat([cos, torch.ones(t, rest, device=dev)], dim=-1)
    sin_full = torch.cat([-sin[:, :half], sin[:, half:], torch.zeros(t, rest, device=dev)], dim=-1)
    perm = torch.cat([torch.arange(half, rope_dim), torch.arange(half), torch.arange(rope_dim, head_dim)]).to(dev)
    return RopeTable(cos_full[:, None, :].to(dtype), sin_full[:, None, :].to(dtype), perm)
