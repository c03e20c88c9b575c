"""Rotary position embedding, neox style (rotate_half) over the first `rope_dim` dims of each head.

This is the convention of Hugging Face Glm4Moe (`apply_rotary_pos_emb` with partial rotary). The model
and the KV-write plugin (which can rope K at its write position for the MTP commit pass) share it.
`rope_table` is the fast form the model uses: cos/sin built once per forward for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, rope_dim] for int positions [T] (computed in fp32, like HF)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.int64, device=positions.device).float() / rope_dim
    inv_freq = 1.0 / (theta**exponents)
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
    half, rest = rope_dim // 2, head_dim - rope_dim
    t = positions.shape[0]
    dev = positions.device
    cos_full = torch.cat([cos, torch.ones(t, rest, device=dev)], dim=-1)
    sin_full = torch.cat([-sin[:, :half], sin[:, half:], torch.zeros(t, rest, device=dev)], dim=-1)
    perm = torch.cat([torch.arange(half, rope_dim), torch.arange(half), torch.arange(rope_dim, head_dim)]).to(dev)
    return RopeTable(cos_full[:, None, :].to(dtype), sin_full[:, None, :].to(dtype), perm)
