"""Triton kernel of `mtp::gdn_step` (semantics: plugins/reference.py `gdn_step_ref`) and its launcher.

One program per (request, value head, block of BV value dims) owns that slice of the recurrent state [Dk, BV] in
registers for the request's whole run of rows: for each row it computes the causal conv of its q / k / v channels
(the window comes from the read slot, or zeros for a fresh sequence, then from the packed rows), silu, the q / k
l2-norms, the gated delta-rule update and its output, and stores the state (and its conv window channels) when the
row has a write slot. The q / k conv channels are shared by the value heads of one key head: only the program of
the first such head (and value block 0) stores their window. Write slots never equal the forward's read slots
(runtime/core/state_pool.py), so programs never race on a slot.

Like plugins/triton_kernels.py: no data-dependent host work (request offsets come from a cumsum over the counts on
device). Tested on CPU under TRITON_INTERPRET=1 only (tests/plugins/test_gdn.py); never run on a GPU here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.triton_kernels import _flag  # a scalar comparison as a proper int1 (Triton 3.9's interpreter)


@triton.jit
def _tap(mixed_ptr, conv_ptr, row0, p, slot, fresh, ch, ch_mask, stride_mixed, C: tl.constexpr, KW: tl.constexpr):
    """The conv input of channels `ch` at request-relative position p (p < 0: the read slot's window, or 0)."""
    from_rows = tl.load(mixed_ptr + (row0 + p) * stride_mixed + ch, mask=ch_mask & _flag(p >= 0), other=0.0).to(tl.float32)
    win = tl.load(conv_ptr + slot * C * (KW - 1) + ch * (KW - 1) + (p + KW - 1), mask=ch_mask & _flag((p < 0) & (fresh == 0)),
                  other=0.0).to(tl.float32)  # fmt: skip
    return from_rows + win


@triton.jit
def _conv(mixed_ptr, conv_ptr, w_ptr, row0, j, slot, fresh, ch, ch_mask, stride_mixed, C: tl.constexpr,
          KW: tl.constexpr):  # fmt: skip
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for t in tl.static_range(KW):
        x = _tap(mixed_ptr, conv_ptr, row0, j - (KW - 1) + t, slot, fresh, ch, ch_mask, stride_mixed, C, KW)
        acc += x * tl.load(w_ptr + ch * KW + t, mask=ch_mask, other=0.0).to(tl.float32)
    return acc / (1.0 + tl.exp(-acc))  # silu


@triton.jit
def _store_window(mixed_ptr, conv_ptr, row0, j, slot, fresh, ws, ch, ch_mask, stride_mixed, C: tl.constexpr,
                  KW: tl.constexpr):  # fmt: skip
    for t in tl.static_range(KW - 1):  # the last K-1 inputs up to row j
        x = _tap(mixed_ptr, conv_ptr, row0, j - (KW - 2) + t, slot, fresh, ch, ch_mask, stride_mixed, C, KW)
        tl.store(conv_ptr + ws * C * (KW - 1) + ch * (KW - 1) + t, x.to(conv_ptr.dtype.element_ty), mask=ch_mask)


@triton.jit
def _gdn_kernel(
    mixed_ptr, b_ptr, a_ptr, counts_ptr, starts_ptr, read_ptr, write_ptr, conv_ptr, ssm_ptr, w_ptr, alog_ptr,
    dtb_ptr, out_ptr, num_requests, stride_mixed, stride_ba,
    C: tl.constexpr, KW: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr,
    BLOCK_R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    r, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rr = tl.arange(0, BLOCK_R)
    counts = tl.load(counts_ptr + rr, mask=rr < num_requests, other=0).to(tl.int64)
    n = tl.sum(tl.where(rr == r, counts, 0), axis=0)
    row0 = tl.sum(tl.where(rr < r, counts, 0), axis=0)
    fresh = (tl.load(starts_ptr + r) == 0).to(tl.int32)
    slot = tl.maximum(tl.load(read_ptr + r).to(tl.int64), 0)
    hk = hv // (HV // HK)
    dk = tl.arange(0, BK)
    dv = vb * BV + tl.arange(0, BV)
    k_mask, v_mask = dk < DK, dv < DV
    q_ch, k_ch, v_ch = hk * DK + dk, HK * DK + hk * DK + dk, 2 * HK * DK + hv * DV + dv
    owns_qk = ((hv % (HV // HK)) == 0) & (vb == 0)  # one program stores the shared q / k window channels
    ssm_off = hv * DK * DV + dk[:, None] * DV + dv[None, :]
    st_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(ssm_ptr + slot * HV * DK * DV + ssm_off, mask=st_mask & _flag(fresh == 0), other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + hv).to(tl.float32)
    for j in range(0, n):
        row = row0 + j
        q = _conv(mixed_ptr, conv_ptr, w_ptr, row0, j, slot, fresh, q_ch, k_mask, stride_mixed, C, KW)
        k = _conv(mixed_ptr, conv_ptr, w_ptr, row0, j, slot, fresh, k_ch, k_mask, stride_mixed, C, KW)
        v = _conv(mixed_ptr, conv_ptr, w_ptr, row0, j, slot, fresh, v_ch, v_mask, stride_mixed, C, KW)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(float(DK)))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        x = tl.load(a_ptr + row * stride_ba + hv).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        decay = tl.exp(-tl.exp(a_log) * softplus)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + row * stride_ba + hv).to(tl.float32)))
        state = state * decay
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        tl.store(out_ptr + row * HV * DV + hv * DV + dv, tl.sum(state * q[:, None], axis=0), mask=v_mask)
        ws = tl.load(write_ptr + row).to(tl.int64)
        if ws >= 0:
            tl.store(ssm_ptr + ws * HV * DK * DV + ssm_off, state, mask=st_mask)
            _store_window(mixed_ptr, conv_ptr, row0, j, slot, fresh, ws, v_ch, v_mask, stride_mixed, C, KW)
            if owns_qk:
                _store_window(mixed_ptr, conv_ptr, row0, j, slot, fresh, ws, q_ch, k_mask, stride_mixed, C, KW)
                _store_window(mixed_ptr, conv_ptr, row0, j, slot, fresh, ws, k_ch, k_mask, stride_mixed, C, KW)


def gdn_step_triton(mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool, ssm_pool, conv_weight, a_log,
                    dt_bias, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:  # fmt: skip
    """Launch `_gdn_kernel` over (requests, value heads, value blocks); same arguments and result as gdn_step_ref."""
    t_rows, c = mixed.shape
    hv, kw, r = a.shape[1], conv_weight.shape[1], q_counts.shape[0]
    out = torch.zeros(t_rows, hv, head_v_dim, dtype=torch.float32, device=mixed.device)
    if t_rows == 0 or r == 0:
        return out
    bv = min(triton.next_power_of_2(head_v_dim), 64)
    mixed, b, a = mixed.contiguous(), b.contiguous(), a.contiguous()
    grid = (r, hv, triton.cdiv(head_v_dim, bv))
    _gdn_kernel[grid](
        mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool, ssm_pool, conv_weight.contiguous(), a_log,
        dt_bias, out, r, mixed.stride(0), b.stride(0),
        C=c, KW=kw, HK=num_k_heads, DK=head_k_dim, HV=hv, DV=head_v_dim, BLOCK_R=triton.next_power_of_2(r),
        BK=triton.next_power_of_2(head_k_dim), BV=bv,
    )  # fmt: skip
    return out
