"""Gated DeltaNet (GDN) token mixing of Qwen3-Next / Qwen3.5 and the recurrent-state cache it reads and writes.

A GDN layer keeps no KV: per request it carries a conv window (the last K-1 projected inputs) and a recurrent
state S [Hv, Dk, Dv]. Both live in a state pool of slots (`GDNStatePool`), indexed per layer; a forward names the
slot each request starts from (`read_slots`) and, per packed row, the slot that receives the state after that row
(`write_slots`, -1 = none). Prefill chunks store only their last row's state; a verify step stores every row's,
so rolling back to the accepted row is a choice of slot, never a recompute or a copy (docs/MODELS.md).

The token mixing is one plugin op, `mtp::gdn_step` (plugins/gdn_ops.py; it takes the pools by address, like the
KV ops; its definition is plugins/reference.py
`gdn_step_ref`; transformers' own GDN functions are the independent reference in tests/plugins/test_gdn.py and, for
the whole model, tests/models/test_hybrid_parity.py).

Tensor parallelism splits a layer by key head, each with the value heads grouped under it (models/sharding.py): a rank
projects, convolves and recurs over its heads only, so its state pool holds its heads' conv channels and states
(`state_geometry(cfg, slots, tp_size=...)`), and out_proj's partial sums meet in one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import plugins.gdn_ops  # noqa: F401  (torch.ops.mtp.gdn_step)
from models.config import ModelConfig
from models.layers import PagedKV, StepMeta, row_parallel
from plugins.gdn_pool import GDNPoolGeometry, address, allocate_state
from plugins.kv_pool import DTYPE_CODES


def state_geometry(cfg: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float32,
                   tp_size: int = 1) -> GDNPoolGeometry:  # fmt: skip
    """The state pool one rank of `cfg` needs with `num_slots` slots: its 1/tp_size of the key and value heads (the one
    rule: the torch executor, the builder, the checks)."""
    hk, hv = cfg.linear_num_key_heads // tp_size, cfg.linear_num_value_heads // tp_size
    conv_dim = 2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim
    return GDNPoolGeometry(len(cfg.gdn_layers), num_slots, conv_dim, cfg.linear_conv_kernel_dim, hk, hv,
                           cfg.linear_key_head_dim, cfg.linear_value_head_dim, DTYPE_CODES[dtype])  # fmt: skip


@dataclass(frozen=True, slots=True)
class GDNStateRef:
    """What a forward hands `mtp::gdn_step`: the pools' addresses (int64[1]) and geometry. An exported graph gets the
    addresses as inputs; the torch executor takes them from its `GDNStatePool`."""

    conv_ptr: torch.Tensor
    ssm_ptr: torch.Tensor
    geom: GDNPoolGeometry


@dataclass(frozen=True, slots=True)
class GDNStatePool:
    """The recurrent state of every GDN layer: conv [G, S, C, K-1] (model dtype) and ssm [G, S, Hv, Dk, Dv] (fp32),
    owned here (stable addresses for the op; plugins/gdn_pool.py)."""

    conv: torch.Tensor
    ssm: torch.Tensor
    ref: GDNStateRef

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp_size: int = 1) -> GDNStatePool:  # fmt: skip
        return cls.of(state_geometry(cfg, num_slots, dtype, tp_size), device)

    @classmethod
    def of(cls, geom: GDNPoolGeometry, device: torch.device | str = "cpu") -> GDNStatePool:
        conv, ssm = allocate_state(geom, device)
        return cls(conv, ssm, GDNStateRef(address(conv), address(ssm), geom))

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def geom(self) -> GDNPoolGeometry:
        return self.ref.geom


@dataclass(frozen=True, slots=True)
class HybridCache:
    """What a hybrid main forward reads and writes: the paged KV of its attention layers and the GDN state slots."""

    kv: PagedKV
    state: GDNStatePool | GDNStateRef
    read_slots: torch.Tensor  # int32 [R] slot each request's state starts from (unused for a fresh sequence)
    write_slots: torch.Tensor  # int32 [T] slot receiving the state after each packed row, -1 = not stored

    @property
    def state_ref(self) -> GDNStateRef:
        return self.state.ref if isinstance(self.state, GDNStatePool) else self.state


class RMSNormGated(nn.Module):
    """GDN output norm: weight * rmsnorm(x) * silu(z) in fp32 (a plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(z.dtype)).float().mul(F.silu(z.float())).to(z.dtype)


class GatedDeltaNet(nn.Module):
    """One GDN layer (`linear_attn.*`). Qwen3-Next packs the projections per key head (`in_proj_qkvz`, `in_proj_ba`);
    Qwen3.5 keeps them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Same math after `project`."""

    def __init__(self, cfg: ModelConfig, state_index: int, tp_size: int = 1) -> None:
        super().__init__()
        self.state_index = state_index  # which layer of the state pool this layer owns
        self.tp_size = tp_size  # this rank holds 1/tp_size of the key heads and of the value heads
        self.hk, self.dk = cfg.linear_num_key_heads // tp_size, cfg.linear_key_head_dim
        self.hv, self.dv = cfg.linear_num_value_heads // tp_size, cfg.linear_value_head_dim
        kd, vd, h = self.hk * self.dk, self.hv * self.dv, cfg.hidden_size
        self.conv_dim = 2 * kd + vd
        self.packed = cfg.model_type == "qwen3_next"
        if self.packed:
            self.in_proj_qkvz = nn.Linear(h, 2 * kd + 2 * vd, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, 2 * kd + vd, bias=False)
            self.in_proj_z = nn.Linear(h, vd, bias=False)
            self.in_proj_b = nn.Linear(h, self.hv, bias=False)
            self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        k = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, padding=k - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(vd, h, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> conv input [T, C] (q, k, v channels), z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        t = x.shape[0]
        if not self.packed:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.hv, self.dv), self.in_proj_b(x),
                    self.in_proj_a(x))  # fmt: skip
        rep = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * rep * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, rep * self.dv, rep * self.dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.hk, 2 * rep), [rep, rep], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, meta: StepMeta, cache: HybridCache) -> torch.Tensor:
        mixed, z, b, a = self.project(x)
        ref = cache.state_ref
        core = torch.ops.mtp.gdn_step(
            mixed, b, a, meta.q_counts, meta.write_starts, cache.read_slots, cache.write_slots, ref.conv_ptr,
            ref.ssm_ptr, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, **ref.geom.attrs(self.state_index),
        )  # fmt: skip
        out = self.norm(core.to(x.dtype), z)
        return row_parallel(self.out_proj, out.reshape(x.shape[0], self.hv * self.dv), self.tp_size)
