"""Which slice of each canonical tensor a rank keeps: `shard_slice`, the one decision the loader, the model's
local shapes and `mtp-build --check` all follow (docs/ARCHITECTURE.md §8, "Mappings").

Tensor parallelism (GQA attention): q heads split H/TP; KV heads split Hkv/TP when Hkv >= TP, else each rank
keeps the one KV head its q heads use; o_proj row-parallel (its input columns split); the dense MLP and shared
experts column-parallel gate/up, row-parallel down; embedding and lm_head vocab-parallel (rows). Routed
experts are whole experts, sliced to the rank's expert range (EP). Everything else (norms, router, eh_proj)
is replicated.

Pure functions of (name, full shape, config, mapping): no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from plugins.mapping import RankMapping, local_kv_heads

Slices = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """The attention heads one TP rank holds: q heads [q_lo, q_lo + q_heads), KV heads [kv_lo, kv_lo + kv_heads)."""

    q_lo: int
    q_heads: int
    kv_lo: int
    kv_heads: int


def head_split(cfg: ModelConfig, m: RankMapping) -> HeadSplit:
    h, hkv, tp, t = cfg.num_attention_heads, cfg.num_key_value_heads, m.tp, m.tp_rank
    q_heads, kv_heads = h // tp, local_kv_heads(hkv, tp)
    if hkv >= tp:
        return HeadSplit(t * q_heads, q_heads, t * kv_heads, kv_heads)
    # Fewer KV heads than ranks: replicate; rank t's q heads all use KV head (first q head) // (q per KV head).
    return HeadSplit(t * q_heads, q_heads, (t * q_heads) // (h // hkv), kv_heads)


def _part(full: int, m: RankMapping) -> slice:
    """The tp_rank-th of tp equal parts of a dimension of size `full`."""
    n = full // m.tp
    return slice(m.tp_rank * n, (m.tp_rank + 1) * n)


def shard_slice(name: str, shape: tuple[int, ...], cfg: ModelConfig, m: RankMapping) -> Slices | None:
    """The slice of canonical tensor `name` (full shape `shape`) that rank `m` keeps; None = the whole tensor.

    Raises ValueError for a tensor this function does not know when tp > 1 (never guess a replication).
    """
    parts = name.split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
    if leaf in ("w_gate_up", "w_down"):  # routed experts [E, ...]: the rank's whole experts
        if m.num_experts == m.experts_per_rank:
            return None
        return (slice(m.expert_lo, m.expert_hi),)
    if m.tp == 1:
        return None
    if module in ("embed_tokens", "lm_head"):  # [V, H]: vocab rows
        return (_part(shape[0], m),)
    if module in ("q_proj", "k_proj", "v_proj"):
        heads = head_split(cfg, m)
        lo, n = (heads.q_lo, heads.q_heads) if module == "q_proj" else (heads.kv_lo, heads.kv_heads)
        d = cfg.head_dim
        return (slice(lo * d, (lo + n) * d),)
    if module == "o_proj":  # [H, Hq*D]: input columns of this rank's q heads
        heads = head_split(cfg, m)
        return (slice(None), slice(heads.q_lo * cfg.head_dim, (heads.q_lo + heads.q_heads) * cfg.head_dim))
    if module in ("gate_proj", "up_proj"):  # dense MLP / shared experts [I, H]: column-parallel
        return (_part(shape[0], m),)
    if module == "down_proj":  # [H, I]: row-parallel (input columns)
        return (slice(None), _part(shape[1], m))
    if module.endswith("norm") or module in ("gate", "eh_proj"):  # norms, the router (and its bias), eh_proj
        return None
    raise ValueError(f"tensor {name}: no tensor-parallel rule for it (models/sharding.py); build with tp_size 1")


def local_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, m: RankMapping) -> tuple[int, ...]:
    """The shape rank `m` holds of tensor `name` (full `shape`)."""
    slices = shard_slice(name, shape, cfg, m)
    if slices is None:
        return tuple(shape)
    out = list(shape)
    for axis, s in enumerate(slices):
        out[axis] = len(range(*s.indices(shape[axis])))
    return tuple(out)
