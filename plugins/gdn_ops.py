"""`mtp::gdn_step`, one Gated DeltaNet layer's token mixing (Qwen3-Next / Qwen3.5), and its CPU implementation.

Semantics: plugins/reference.py `gdn_step_ref` (the row-by-row definition): a causal depthwise conv over the
request's conv window (zeros for a fresh sequence), silu, l2-normalised q/k, and the gated delta rule over the
recurrent state; the state after a row goes to that row's write slot (-1: not stored). Decode/verify rows and
prefill chunks are the same op: requests are packed, a request with 0 rows (padding) reads and writes nothing.

The op takes the state pools by address plus their geometry (plugins/gdn_pool.py), like the KV write ops take the
KV pool, and writes its layer's slots in place: one form for the torch executor, the ONNX node `GdnStep`, the ONNX
Runtime op and the TensorRT plugin (its spec: plugins/op_spec.py). `gdn_step_tensors` is the same computation on
one layer's pool tensors [S, C, K-1] / [S, Hv, Dk, Dv].

The op's CPU kernel is C++ (plugins/csrc/gdn_step.cpp, loaded by plugins/cpp_ops.py, like every plugin op's):
eager torch and the ONNX Runtime op call it; runs of prompt rows take the chunked delta rule there
(plugins/csrc/gdn_chunk.h, docs/MODELS.md "Prefill"). CUDA tensors go through `_op` to the Triton kernel
(plugins/gdn_triton.py). `gdn_step_tensors` is the torch form on one layer's pool tensors: on CPU it vectorises over
requests and heads (the conv of every row at once, an unfold over window ++ rows, then the recurrence one row index
at a time for all requests together); the GDN rollback bench (runtime/bench/gdn_rollback.py) runs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import plugins.cpp_ops  # noqa: F401  (defines mtp::gdn_step's schema and registers its C++ CPU kernel)
from plugins.gdn_pool import GDNPoolGeometry, layer_views
from plugins.op_backends import define_torch
from plugins.op_spec import SPECS


def _geometry(num_layers, num_slots, conv_dim, conv_kernel, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
              dtype) -> GDNPoolGeometry:  # fmt: skip
    return GDNPoolGeometry(num_layers, num_slots, conv_dim, conv_kernel, num_k_heads, num_v_heads, head_k_dim,
                           head_v_dim, dtype)  # fmt: skip


def _op(mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool_ptr, ssm_pool_ptr, conv_weight, a_log,
        dt_bias, layer, num_layers, num_slots, conv_dim, conv_kernel, num_k_heads, num_v_heads, head_k_dim,
        head_v_dim, dtype):  # fmt: skip
    """The CUDA kernel (the CPU one is C++): view the layer's pools at the addresses, run the tensor form."""
    geom = _geometry(num_layers, num_slots, conv_dim, conv_kernel, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                     dtype)  # fmt: skip
    if mixed.shape[1] != conv_dim or a.shape[1] != num_v_heads or tuple(conv_weight.shape) != (conv_dim, conv_kernel):
        raise ValueError(f"gdn_step: inputs mixed {list(mixed.shape)}, a {list(a.shape)}, conv_weight "
                         f"{list(conv_weight.shape)} do not match the node's geometry {geom}")  # fmt: skip
    conv, ssm = layer_views(int(conv_pool_ptr[0]), int(ssm_pool_ptr[0]), geom, layer, mixed.device)
    return gdn_step_tensors(mixed, b, a, q_counts, starts, read_slots, write_slots, conv, ssm, conv_weight, a_log,
                            dt_bias, num_k_heads, head_k_dim, head_v_dim)  # fmt: skip


define_torch(SPECS["gdn_step"])  # the C++ library's schema checked against the spec; the fake from its shape rule
torch.library.impl("mtp::gdn_step", "CUDA")(_op)  # the tensor form sends CUDA tensors to the Triton kernel


def gdn_step_tensors(
    mixed: torch.Tensor,  # [T, C] conv input rows (q, k, v channels), packed by request
    b: torch.Tensor,  # [T, Hv]
    a: torch.Tensor,  # [T, Hv]
    q_counts: torch.Tensor,  # int32 [R] rows per request (0 = padded)
    starts: torch.Tensor,  # int32 [R] first position (0 = fresh sequence: zero state, the slot is not read)
    read_slots: torch.Tensor,  # int32 [R]
    write_slots: torch.Tensor,  # int32 [T] (-1 = not stored)
    conv_pool: torch.Tensor,  # [S, C, K-1]
    ssm_pool: torch.Tensor,  # [S, Hv, Dk, Dv] fp32
    conv_weight: torch.Tensor,  # [C, K]
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> torch.Tensor:
    """-> core output [T, Hv, Dv] fp32 (before the gated output norm). CUDA inputs run the Triton kernel."""
    if mixed.is_cuda:  # not executed here (no GPU); the kernel is tested under TRITON_INTERPRET=1
        from plugins.gdn_triton import gdn_step_triton

        return gdn_step_triton(mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool, ssm_pool, conv_weight,
                               a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim)  # fmt: skip
    t_rows, c = mixed.shape
    hv, kk = a.shape[1], conv_weight.shape[1]
    out = torch.zeros(t_rows, hv, head_v_dim, dtype=torch.float32, device=mixed.device)
    counts = q_counts.long()
    if t_rows == 0 or int(counts.sum()) == 0:
        return out
    qmax = int(counts.max())
    offsets = torch.cumsum(counts, 0) - counts
    steps = torch.arange(qmax, device=mixed.device)
    valid = steps[None, :] < counts[:, None]  # [R, qmax]
    rows = (offsets[:, None] + steps[None, :]).clamp(max=t_rows - 1)  # [R, qmax] packed row of (request, step)
    fresh = (starts == 0)[:, None, None]
    slot = read_slots.long().clamp(min=0)
    window = torch.where(fresh, 0.0, conv_pool[slot].float())  # [R, C, K-1]; where(): a poisoned slot never leaks
    state = torch.where(fresh[..., None], 0.0, ssm_pool[slot].float())  # [R, Hv, Dk, Dv]
    x = mixed.float()[rows] * valid[..., None]  # [R, qmax, C]
    seq = torch.cat([window, x.transpose(1, 2)], dim=2)  # [R, C, K-1+qmax]
    conv = F.silu((seq.unfold(2, kk, 1) * conv_weight.float()[None, :, None, :]).sum(-1)).transpose(1, 2)
    kd, rep = num_k_heads * head_k_dim, hv // num_k_heads
    r_n = counts.shape[0]
    q = conv[..., :kd].reshape(r_n, qmax, num_k_heads, head_k_dim).repeat_interleave(rep, 2)
    k = conv[..., kd : 2 * kd].reshape(r_n, qmax, num_k_heads, head_k_dim).repeat_interleave(rep, 2)
    v = conv[..., 2 * kd :].reshape(r_n, qmax, hv, head_v_dim)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * head_k_dim**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    decay = (-a_log.float().exp() * F.softplus(a.float()[rows] + dt_bias.float())).exp()  # [R, qmax, Hv]
    beta = b.float()[rows].sigmoid()
    writes = torch.where(valid, write_slots.long()[rows], -1)  # [R, qmax]
    outs = []
    for j in range(qmax):
        live = valid[:, j][:, None, None, None]
        s = state * decay[:, j, :, None, None]
        delta = (v[:, j] - (s * k[:, j, :, :, None]).sum(2)) * beta[:, j, :, None]  # [R, Hv, Dv]
        s = s + k[:, j, :, :, None] * delta[:, :, None, :]
        state = torch.where(live, s, state)
        outs.append((state * q[:, j, :, :, None]).sum(2))
        store = writes[:, j] >= 0
        if bool(store.any()):
            dst = writes[store, j]
            ssm_pool[dst] = state[store].to(ssm_pool.dtype)
            conv_pool[dst] = seq[store, :, j + 1 : j + kk].to(conv_pool.dtype)
    per_step = torch.stack(outs, dim=1)  # [R, qmax, Hv, Dv]
    out[rows[valid]] = per_step[valid]
    return out
