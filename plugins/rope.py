"""Rotary position embedding, neox style (rotate_half) over the first `rope_dim` dims of each head.

This is the convention of Hugging Face Glm4Moe (`apply_rotary_pos_emb` with partial rotary). The model
and the KV-write plugin (which can rope K at its write position for the MTP commit pass) share it.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, rope_dim] for int positions [T] (computed in fp32, like HF)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates x[..., :rope_dim] at `positions` [T]; the rest passes through."""
    cos, sin = rope_cos_sin(positions, rope_dim, theta)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rope_dim], x[..., rope_dim:]
    half = rope_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
