"""The plugin ops the model calls: `mtp::kv_write`, `mtp::paged_attention`, `mtp::moe_experts` (MLA: mla_ops.py).

Their schemas and CPU kernels are C++ (plugins/csrc/, loaded by plugins/cpp_ops.py): eager torch, torch.compile,
AOTInductor and the ONNX Runtime ops all call the same kernel, with no Python on the single-rank CPU path. This
module adds what Python owns: the fakes, derived from the op specs (plugins/op_spec.py; torch.export and
torch.compile trace through them), the CUDA implementations (the Triton kernels), and, by importing
plugins/moe_ep.py, the MPI exchange the C++ moe_experts calls for ep_size > 1 or tp_size > 1.

The KV pool travels by address (int64[1]) plus geometry ints, exactly as the plugin nodes in the exported
graphs do (plugins/kv_pool.py says why). kv_write returns a 1-element int64 tensor (rows stored);
paged_attention takes it as `after` so the read is ordered after the write in every graph (nothing else ties
them together: the pool is not a tensor the graph sees). Semantics: plugins/reference.py.

`moe_experts_local` below is the torch version of the local expert compute: autograd-able, the training
forward's path (models/feed_forward.py `forward_train`); inference runs the C++ `mtp::moe_experts_local`.
"""

from __future__ import annotations

import torch

import plugins.cpp_ops  # noqa: F401  (defines the mtp:: schemas and registers the C++ CPU kernels)
import plugins.moe_ep  # noqa: F401  (implements mtp::moe_experts_exchange, the EP/TP token exchange)
from plugins.kv_pool import KVPoolGeometry
from plugins.op_backends import define_torch
from plugins.op_spec import SPECS

for _op in ("kv_write", "paged_attention", "moe_experts", "linear_bf16"):
    define_torch(SPECS[_op])  # the C++ library's schema checked against the spec; the fake from its shape rule


def _geometry(num_planes: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: int):
    return KVPoolGeometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)


@torch.library.impl("mtp::kv_write", "CUDA")
def _(k, v, counts, starts, block_tables, pool_ptr, plane, num_planes, num_blocks, block_size, num_kv_heads,
      head_dim, dtype, rope_dim, rope_theta):  # fmt: skip
    from plugins.triton_kernels import kv_write_triton

    geom = _geometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return kv_write_triton(k, v, counts, starts, block_tables, int(pool_ptr[0]), plane, geom, rope_dim, rope_theta)


@torch.library.impl("mtp::paged_attention", "CUDA")
def _(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane, num_planes, num_blocks, block_size, num_kv_heads,
      head_dim, dtype, scale):  # fmt: skip
    from plugins.triton_kernels import paged_attention_triton

    geom = _geometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return paged_attention_triton(q, q_counts, kv_lens, block_tables, int(pool_ptr[0]), plane, geom, scale)


@torch.library.register_fake("mtp::linear_fp8")
def _(x, weight, scale_inv, bias):
    """fp32 [..., N] (plugins/reference.py linear_fp8_ref). Not an OpSpec: no graph node (ONNX, TensorRT) takes an
    FP8 weight; only the compiled (AOTInductor) packages call it, like linear_bf16."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("mtp::linear_int8")
def _(x, weight, scale, bias):
    """fp32 [..., N] (plugins/reference.py linear_int8_ref); like linear_fp8 only the compiled packages call it."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("mtp::linear_int4")
def _(x, weight, scale, group_size, bias):
    """fp32 [..., N] (plugins/reference.py linear_int4_ref); like linear_fp8 only the compiled packages call it."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("mtp::moe_experts_fp8")
def _(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, expert_offset):
    """fp32 [T, H] (plugins/reference.py moe_experts_fp8_ref); like linear_fp8 only the compiled packages call it."""
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.register_fake("mtp::moe_experts_int8")
def _(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, expert_offset):
    """fp32 [T, H] (plugins/reference.py moe_experts_int8_ref); like linear_fp8 only the compiled packages call it."""
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.register_fake("mtp::moe_experts_int4")
def _(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, group_size, expert_offset):
    """fp32 [T, H] (plugins/reference.py moe_experts_int4_ref); like linear_fp8 only the compiled packages call it."""
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.register_fake("mtp::moe_experts_local")
def _(x, topk_ids, topk_weights, w_gate_up, w_down, expert_offset):
    return torch.empty_like(x)


def moe_experts_local(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_offset: int,
) -> torch.Tensor:
    """The experts held locally (global ids offset..offset+E_local-1), in fp32, returned in x's dtype.

    Three strategies, one result (up to fp32 rounding), chosen by `choose_experts_strategy`:
      gathered  few (row, expert) pairs (decode): the selected experts' weights gathered per pair, two
                batched GEMMs; a fixed handful of ops whatever the experts
      dense     rows touching most experts (verify steps, small batches): every expert on every row as
                batched GEMMs, unselected pairs weighted 0
      loop      otherwise (prefill): a loop over the selected experts only, no wasted FLOPs
    """
    num_local, top_k = w_gate_up.shape[0], topk_ids.shape[1]
    inter, hidden = w_gate_up.shape[1] // 2, x.shape[1]
    flat = (topk_ids - expert_offset).flatten()
    xs = x.float()
    expert_bytes = (w_gate_up.numel() + w_down.numel()) // max(num_local, 1) * w_down.element_size()
    if choose_experts_strategy(flat.shape[0], 0, num_local, top_k, inter, hidden, expert_bytes) == "gathered":
        lo, hi = torch.aminmax(flat) if flat.shape[0] else (torch.tensor(0), torch.tensor(0))
        if int(lo) >= 0 and int(hi) < num_local:  # an expert held by another rank: the loop skips it
            rows = xs.repeat_interleave(top_k, 0)[:, None, :]  # [T*K, 1, H]
            gate, up = torch.bmm(rows, w_gate_up.index_select(0, flat).float().transpose(1, 2)).chunk(2, dim=-1)
            y = torch.bmm(torch.nn.functional.silu(gate) * up, w_down.index_select(0, flat).float().transpose(1, 2))
            return (y.view(-1, top_k, hidden) * topk_weights.float()[:, :, None]).sum(1).to(x.dtype)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept within one
    ids, sizes = torch.unique_consecutive(flat[order], return_counts=True)
    ids_list = ids.tolist()
    touched = sum(0 <= e < num_local for e in ids_list)
    strategy = choose_experts_strategy(flat.shape[0], touched, num_local, top_k, inter, hidden, expert_bytes)
    if strategy == "dense":
        column = torch.where((flat >= 0) & (flat < num_local), flat, num_local).view(-1, top_k)  # other ranks: last
        dense_w = torch.zeros(x.shape[0], num_local + 1, device=x.device).scatter_add_(1, column, topk_weights.float())
        dense_w = dense_w[:, :num_local]  # [T, E_local], 0 = not selected
        gate_up = torch.matmul(xs, w_gate_up.float().transpose(1, 2))  # [E_local, T, 2I]
        h = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        y = torch.bmm(h, w_down.float().transpose(1, 2))  # [E_local, T, H]
        return (y * dense_w.t()[:, :, None]).sum(0).to(x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    tok_all, w_all = order // top_k, topk_weights.flatten()[order].float()
    offset = 0
    for e, n in zip(ids_list, sizes.tolist(), strict=True):
        if 0 <= e < num_local:  # else: held by another rank
            tok = tok_all[offset : offset + n]
            gate, up = torch.nn.functional.linear(xs[tok], w_gate_up[e].float()).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down[e].float())
            out.index_add_(0, tok, y * w_all[offset : offset + n, None])
        offset += n
    return out.to(x.dtype)


def choose_experts_strategy(pairs: int, touched: int, num_local: int, top_k: int, inter: int, hidden: int,
                            expert_bytes: int) -> str:  # fmt: skip
    """"gathered", "dense" or "loop" for `pairs` (row, expert) pairs; `touched` = 0: not yet counted.

    Costs in GEMM-FLOP equivalents of one core (~100 GFLOP/s; a byte read ~4 FLOPs; one eager op
    ~OP_FLOPS). gathered copies each pair's expert weights (worth it for small experts only); dense
    computes every (row, expert) pair and reads every expert; the loop pays ~10 ops per touched expert.
    Constants calibrated in docs/PERFORMANCE.md ("MoE cost model calibration"): on models/tiny's
    width gathered wins up to 8 rows at top-2, dense at 8..16 rows, the loop from 32 rows.
    """
    pair = 6 * inter * hidden  # gate|up and down GEMMs of one (row, expert) pair
    rows = pairs // max(top_k, 1)
    if pairs <= GATHER_MAX_PAIRS and expert_bytes <= GATHER_MAX_EXPERT_BYTES:
        return "gathered"
    if touched < 2:
        return "loop"
    dense = 12 * OP_FLOPS + rows * num_local * pair + num_local * expert_bytes * 4
    loop = 6 * OP_FLOPS + touched * (10 * OP_FLOPS + expert_bytes * 4) + pairs * pair
    return "dense" if dense < loop else "loop"


OP_FLOPS = 2.5e5  # one eager torch op (~2.5 us) in GEMM-FLOP equivalents
GATHER_MAX_PAIRS = 16
GATHER_MAX_EXPERT_BYTES = 1 << 20  # a bigger expert costs more to copy than the dispatch it saves
