"""`mtp::gdn_step` (plugins/gdn_ops.py, the CPU op) and its Triton kernel (plugins/gdn_triton.py, TRITON_INTERPRET=1 on
CPU) == plugins/reference.py `gdn_step_ref` == transformers' own GDN functions (`causal_conv1d_fn` /
`torch_chunk_gated_delta_rule` over a whole sequence); padded requests and unstored rows leave the state pools
untouched; a fresh sequence never reads its (poisoned) slot."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton / plugins.gdn_triton

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import plugins.gdn_ops  # noqa: F401  (torch.ops.mtp.gdn_step)
from plugins.gdn_pool import GDNPoolGeometry, address
from plugins.reference import gdn_step_ref

HK, DK, HV, DV, K = 2, 8, 4, 6, 4
C = 2 * HK * DK + HV * DV
I32 = torch.int32


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(C, K, generator=g), 0.5 * torch.randn(HV, generator=g), 0.5 * torch.randn(HV, generator=g))


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, C, generator=g), torch.randn(n, HV, generator=g), torch.randn(n, HV, generator=g)


def pools(slots=8, fill=float("nan")):
    return torch.full((slots, C, K - 1), fill), torch.full((slots, HV, DK, DV), fill)


def op(mixed, b, a, counts, starts, reads, writes, conv, ssm, w, a_log, dt, hk, dk, dv):
    """`mtp::gdn_step` itself: the pools [S, C, K-1] / [S, Hv, Dk, Dv] by address, as layer 0 of a 1-layer pool."""
    geom = GDNPoolGeometry(1, conv.shape[0], conv.shape[1], conv.shape[2] + 1, hk, a.shape[1], dk, dv)
    return torch.ops.mtp.gdn_step(mixed, b, a, counts, starts, reads, writes, address(conv), address(ssm), w, a_log,
                                  dt, **geom.attrs(0))


def both(mixed, b, a, counts, starts, reads, writes, conv, ssm, impl="op"):
    """Run `impl` and the reference on copies of the same pools; return both (out, conv, ssm)."""
    from plugins.gdn_triton import gdn_step_triton

    w, a_log, dt = params()
    args = lambda c, s: (mixed, b, a, torch.tensor(counts, dtype=I32), torch.tensor(starts, dtype=I32),  # noqa: E731
                         torch.tensor(reads, dtype=I32), torch.tensor(writes, dtype=I32), c, s, w, a_log, dt, HK, DK, DV)
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    fn = op if impl == "op" else gdn_step_triton
    return (fn(*args(c1, s1)), c1, s1), (gdn_step_ref(*args(c2, s2)), c2, s2)


@pytest.mark.parametrize("impl", ["op", "triton"])
def test_op_equals_reference_on_a_packed_mixed_batch(impl):
    """Requests: a fresh 5-row prefill (last row stored), a padded one, a 3-row verify continuing from slot 2 (every
    row stored), a fresh 1-row one (nothing stored)."""
    conv, ssm = pools(fill=0.0)
    g = torch.Generator().manual_seed(9)
    conv[2], ssm[2] = torch.randn(C, K - 1, generator=g), 0.1 * torch.randn(HV, DK, DV, generator=g)
    mixed, b, a = rows(9, 1)
    writes = [-1, -1, -1, -1, 0] + [3, 4, 7] + [-1]  # never the slot a request reads (runtime/core/state_pool.py)
    (o1, c1, s1), (o2, c2, s2) = both(mixed, b, a, [5, 0, 3, 1], [0, 7, 7, 0], [6, -1, 2, 5], writes, conv, ssm, impl)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c1, c2, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert o1.abs().max() > 0.05


def hf_reference(mixed, b, a):
    """transformers' own functions over a whole sequence, wired as Qwen3NextGatedDeltaNet.forward does."""
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    w, a_log, dt = params()
    x = m.causal_conv1d_fn(mixed.T[None], w, None, activation="silu").transpose(1, 2)  # [1, n, C]
    q, k, v = torch.split(x, [HK * DK, HK * DK, HV * DV], dim=-1)
    n = mixed.shape[0]
    g = -a_log.exp() * F.softplus(a + dt)
    out, state = m.torch_chunk_gated_delta_rule(q.reshape(1, n, HK, DK), k.reshape(1, n, HK, DK),
                                                v.reshape(1, n, HV, DV), g=g[None], beta=b.sigmoid()[None],
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    return out[0], state[0]


@pytest.mark.parametrize("split", [1, 4, 7])
def test_chunked_rows_equal_transformers_whole_sequence(split):
    """A prefill of `split` rows, then the rest continuing from the stored slot, == transformers over all rows."""
    mixed, b, a = rows(11, 2)
    expected, final_state = hf_reference(mixed, b, a)
    conv, ssm = pools()
    w, a_log, dt = params()
    n = mixed.shape[0]
    first = op(mixed[:split], b[:split], a[:split], torch.tensor([split], dtype=I32),
                                   torch.tensor([0], dtype=I32), torch.tensor([5], dtype=I32),
                                   torch.tensor([-1] * (split - 1) + [3], dtype=I32), conv, ssm, w, a_log, dt, HK, DK,
                                   DV)  # fmt: skip
    rest = op(mixed[split:], b[split:], a[split:], torch.tensor([n - split], dtype=I32),
                                  torch.tensor([split], dtype=I32), torch.tensor([3], dtype=I32),
                                  torch.tensor([-1] * (n - split - 1) + [1], dtype=I32), conv, ssm, w, a_log, dt, HK,
                                  DK, DV)  # fmt: skip
    torch.testing.assert_close(torch.cat([first, rest]), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm[1], final_state, atol=1e-5, rtol=1e-5)


def test_dropping_the_conv_window_fails_the_comparison():
    """The comparison above can fail: continuing from a zeroed conv window (a dropped conv state) differs."""
    mixed, b, a = rows(11, 2)
    expected, _ = hf_reference(mixed, b, a)
    conv, ssm = pools()
    w, a_log, dt = params()
    op(mixed[:4], b[:4], a[:4], torch.tensor([4], dtype=I32), torch.tensor([0], dtype=I32),
                           torch.tensor([0], dtype=I32), torch.tensor([-1, -1, -1, 3], dtype=I32), conv, ssm, w, a_log,
                           dt, HK, DK, DV)  # fmt: skip
    conv[3] = 0.0
    rest = op(mixed[4:], b[4:], a[4:], torch.tensor([7], dtype=I32), torch.tensor([4], dtype=I32),
                                  torch.tensor([3], dtype=I32), torch.tensor([-1] * 7, dtype=I32), conv, ssm, w, a_log,
                                  dt, HK, DK, DV)  # fmt: skip
    assert (rest - expected[4:]).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["op", "reference", "triton"])
def test_padded_requests_and_unstored_rows_touch_nothing(impl):
    """Every pool slot NaN: padded requests (0 rows) and rows with write slot -1 leave every slot bit-identical, a
    fresh request never reads its NaN slot, and the one stored row writes exactly its slot."""
    conv, ssm = pools()
    mixed, b, a = rows(3, 3)
    w, a_log, dt = params()
    from plugins.gdn_triton import gdn_step_triton

    fn = {"op": op, "reference": gdn_step_ref, "triton": gdn_step_triton}[impl]
    out = fn(mixed, b, a, torch.tensor([0, 3, 0], dtype=I32), torch.tensor([9, 0, 4], dtype=I32),
             torch.tensor([1, 2, 4], dtype=I32), torch.tensor([-1, -1, 6], dtype=I32), conv, ssm, w, a_log, dt, HK,
             DK, DV)  # fmt: skip
    assert torch.isfinite(out).all()
    untouched = [s for s in range(8) if s != 6]
    assert conv[untouched].isnan().all() and ssm[untouched].isnan().all()
    assert torch.isfinite(conv[6]).all() and torch.isfinite(ssm[6]).all()
    empty = fn(mixed[:0], b[:0], a[:0], torch.tensor([0, 0], dtype=I32), torch.tensor([0, 0], dtype=I32),
               torch.tensor([0, 1], dtype=I32), torch.tensor([], dtype=I32), conv, ssm, w, a_log, dt, HK, DK, DV)
    assert empty.shape == (0, HV, DV) and ssm[untouched].isnan().all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), counts=st.lists(st.integers(0, 4), min_size=1, max_size=4),
       dims=st.sampled_from([(HK, DK, HV, DV, K), (1, 32, 2, 24, 3), (2, 16, 2, 16, 4)]),
       conv_dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())  # fmt: skip
def test_cpp_kernel_matches_reference_on_random_batches(seed, counts, dims, conv_dtype, data):
    """The C++ CPU kernel (plugins/csrc/gdn_step.cpp) == gdn_step_ref on random packed batches: padded requests,
    fresh and continuing ones, unstored rows, a bf16 conv pool, every other slot NaN (never read, never written)."""
    hk, dk, hv, dv, kk = dims
    c, n = 2 * hk * dk + hv * dv, sum(counts)
    g = torch.Generator().manual_seed(seed)
    slots = len(counts) + n + 1  # request r reads slot r; row t may store into slot len(counts) + t (never a read slot)
    conv = torch.full((slots, c, kk - 1), float("nan")).to(conv_dtype)
    ssm = torch.full((slots, hv, dk, dv), float("nan"))
    starts = [data.draw(st.sampled_from([0, 5])) for _ in counts]
    for r, s in enumerate(starts):
        if s:  # a continuing request's slot holds a real state
            conv[r] = torch.randn(c, kk - 1, generator=g).to(conv_dtype)
            ssm[r] = 0.1 * torch.randn(hv, dk, dv, generator=g)
    writes = [len(counts) + t if data.draw(st.booleans()) else -1 for t in range(n)]
    mixed, b, a = torch.randn(n, c, generator=g), torch.randn(n, hv, generator=g), torch.randn(n, hv, generator=g)
    w, a_log, dt = 0.3 * torch.randn(c, kk, generator=g), 0.5 * torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    ints = [torch.tensor(x, dtype=I32) for x in (counts, starts, list(range(len(counts))), writes)]
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    geom = GDNPoolGeometry(1, slots, c, kk, hk, hv, dk, dv, {torch.float32: 0, torch.bfloat16: 2}[conv_dtype])
    out = torch.ops.mtp.gdn_step(mixed, b, a, *ints, address(c1), address(s1), w, a_log, dt, **geom.attrs(0))
    ref = gdn_step_ref(mixed, b, a, *ints, c2, s2, w, a_log, dt, hk, dk, dv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c1, c2, atol=0, rtol=0, equal_nan=True)  # windows are copies: exact, NaN kept
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_bad_input_is_one_line_value_error():
    conv, ssm = pools()
    mixed, b, a = rows(2, 4)
    w, a_log, dt = params()
    one, two = torch.tensor([1, 1], dtype=I32), torch.tensor([-1, -1], dtype=I32)
    geom = GDNPoolGeometry(1, conv.shape[0], C, K, HK, HV, DK, DV)

    def call(mixed=mixed, reads=(0, 1), starts=(3, 3), conv_ptr=None, **attrs):
        return torch.ops.mtp.gdn_step(mixed, b, a, one, torch.tensor(starts, dtype=I32), torch.tensor(reads, dtype=I32),
                                      two, address(conv) if conv_ptr is None else conv_ptr, address(ssm), w, a_log, dt,
                                      **{**geom.attrs(0), **attrs})  # fmt: skip

    bad = [(lambda: call(mixed=mixed[:, :5]), "do not match the node's geometry"),
           (lambda: call(reads=(0, 99)), r"read_slots\[1\] = 99 is outside the pool's 8 slots"),
           (lambda: call(conv_ptr=torch.zeros(1, dtype=torch.int64)), "state pool address is 0"),
           (lambda: call(layer=1), "GDN layer 1 is outside the state pool's 1 layers"),
           (lambda: call(conv_dim=C + 1), "is inconsistent")]  # fmt: skip
    for fn, message in bad:
        with pytest.raises(ValueError, match=message) as err:
            fn()
        assert "\n" not in str(err.value).strip(), str(err.value)
    assert call(reads=(0, 99), starts=(3, 0)).shape == (2, HV, DV)  # a fresh request's read slot is never looked at
