"""Which slice of each canonical tensor a rank keeps: `shard_slice`, the one decision the loader, the model's
local shapes and `mtp-build --check` all follow (docs/ARCHITECTURE.md §8, "Mappings").

Tensor parallelism (GQA attention): q heads split H/TP; KV heads split Hkv/TP when Hkv >= TP, else each rank
keeps the one KV head its q heads use; o_proj row-parallel (its input columns split); the dense MLP and shared
experts column-parallel gate/up, row-parallel down; embedding and lm_head vocab-parallel (rows). Routed
experts are whole experts, sliced to the rank's expert range (EP). Everything else (norms, router, eh_proj)
is replicated.

MLA attention: q_proj / q_b_proj and kv_b_proj rows by attention head, o_proj columns by head; the latent
projections (q_a_proj, kv_a_proj_with_mqa and their norms) replicated, so every rank writes the same latent pool.
Gated DeltaNet (models/gdn.py): split by key head, each with the value heads grouped under it (value head j
belongs to key head j // (Hv/Hk)), so rank t holds key heads [t*Hk/TP, ...) and value heads [t*Hv/TP, ...). The
packed Qwen3-Next projections are laid out per key head (one window); the conv channels and Qwen3.5's in_proj_qkv are
[q | k | v] over all heads, so a rank's rows there are three windows (`shard_pieces`). out_proj row-parallel.

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

    Raises ValueError for a tensor this function does not know when tp > 1 (never guess a replication), and for the
    GDN [q | k | v] channels, which take three windows (`shard_pieces`, what the loader reads).
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
    if module in ("o_proj", "out_proj") and leaf == "bias":  # a row-parallel output's bias is added once, after the sum
        return None
    if module in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"):
        # rows per head: D (GQA), 2D (Qwen3-Next's [q ; gate]), nope + rope (MLA q), nope + v (MLA kv_b)
        heads = head_split(cfg, m)
        kv = module in ("k_proj", "v_proj")
        lo, n = (heads.kv_lo, heads.kv_heads) if kv else (heads.q_lo, heads.q_heads)
        d = shape[0] // (cfg.num_key_value_heads if kv else cfg.num_attention_heads)
        return (slice(lo * d, (lo + n) * d),)
    if module == "o_proj":  # [H, Hq*D]: input columns of this rank's q heads (MLA: D = v_head_dim)
        heads, d = head_split(cfg, m), shape[1] // cfg.num_attention_heads
        return (slice(None), slice(heads.q_lo * d, (heads.q_lo + heads.q_heads) * d))
    if module in ("q_a_proj", "kv_a_proj_with_mqa", "shared_expert_gate"):  # MLA latent, Qwen3-Next's gate: replicated
        return None
    if module in ("in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a") or leaf in ("dt_bias", "A_log"):
        return (_part(shape[0], m),)  # per key head (packed) or per value head: one window
    if module == "out_proj":  # GDN [H, Hv*Dv]: row-parallel
        return (slice(None), _part(shape[1], m))
    if module in ("gate_proj", "up_proj"):  # dense MLP / shared experts [I, H]: column-parallel
        return (_part(shape[0], m),)
    if module == "down_proj":  # [H, I]: row-parallel (input columns)
        return (slice(None), _part(shape[1], m))
    if module.endswith("norm") or module.startswith("pre_fc_norm") or module in ("gate", "eh_proj", "fc"):
        return None  # norms (Qwen3-Next's MTP pre_fc_norm_*), the router (+ bias), eh_proj / fc
    raise ValueError(f"tensor {name}: no tensor-parallel rule for it (models/sharding.py); build with tp_size 1")


def shard_pieces(name: str, shape: tuple[int, ...], cfg: ModelConfig, m: RankMapping) -> tuple[Slices, ...] | None:
    """The windows of tensor `name` rank `m` keeps, concatenated along axis 0 in order; None = the whole tensor.

    One window (`shard_slice`) for every tensor but a Gated DeltaNet layer's [q | k | v] channels (conv1d, Qwen3.5's
    in_proj_qkv): the rank's q rows, k rows and v rows."""
    parts = name.split(".")
    if m.tp > 1 and parts[-1] == "weight" and parts[-2] in ("conv1d", "in_proj_qkv"):
        kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        q, k, v = (_part(n, m) for n in (kd, kd, vd))
        rest = (slice(None),) * (len(shape) - 1)
        return tuple((slice(lo + s.start, lo + s.stop), *rest) for lo, s in ((0, q), (kd, k), (2 * kd, v)))
    one = shard_slice(name, shape, cfg, m)
    return None if one is None else (one,)


def local_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, m: RankMapping) -> tuple[int, ...]:
    """The shape rank `m` holds of tensor `name` (full `shape`)."""
    pieces = shard_pieces(name, shape, cfg, m)
    if pieces is None:
        return tuple(shape)
    out = list(shape)
    for axis in range(len(shape)):
        sizes = [len(range(*p[axis].indices(shape[axis]))) for p in pieces if axis < len(p)]
        if sizes:
            out[axis] = sum(sizes) if axis == 0 else sizes[0]
    return tuple(out)
