"""mtp::moe_experts_int4 (plugins/csrc/moe_experts.cpp): the routed experts over `mtp-build --quantize int4`'s expert
weights (group-wise int4, two values per byte, one fp32 scale per group_size input features of each row of each
expert; plugins/reference.py quantize_int4), against plugins/reference.py moe_experts_int4_ref.

On every instruction set this CPU has, 0-24 tokens, top-k 1-4, routings where some pairs' experts are held elsewhere,
one expert chosen by every token and another by none, and group sizes whose groups end inside a vector step (6, 40:
AVX-512's masked step, AVX2's scalar tail) or on one (32, 64, 128). Weights either quantized from float experts as the
builder does or raw bytes (every nibble, -8 included, which quantize_int4 never writes but the kernel reads) with
random scales. Two checks, as tests/plugins/test_moe_experts_int8.py: test_moe_experts_fp8.py's bound (first-order
fp32 rounding propagated in fp64 from the same dequantized weights) and closeness to the reference at rtol 1e-4, which
sees one group's scale 5% off (test_a_planted_wrong_scale_is_caught). Thread-count invariance:
tests/plugins/test_cpp_ops.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401  (the fake)
from plugins.reference import dequantize_int4_ref, moe_experts_int4_ref, quantize_int4
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512
from tests.plugins.test_moe_experts_fp8 import experts_agree
from tests.plugins.test_moe_experts_int8 import _routing

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
# (group, hidden, inter): groups ending inside a 16- and an 8-column step (6, 40), on one (32, 64, 128), the smallest (2)
SHAPES = [(6, 24, 18), (40, 160, 120), (32, 128, 96), (64, 192, 128), (128, 256, 128), (2, 10, 6)]


def _case(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, group: int, offset: int = 0,
          ragged: bool = False, raw: bool = False):  # fmt: skip
    """Float experts quantized as the builder quantizes them (quantize_int4 of each stack), or (raw) random bytes with
    random positive and negative scales."""
    g = torch.Generator().manual_seed(seed)

    def weights(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        if raw:
            packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.uint8)
            return packed, torch.randn(experts, rows, cols // group, generator=g) * 0.02
        return quantize_int4(torch.randn(experts, rows, cols, generator=g) * 0.08, group)

    (gu, sgu), (dn, sdn) = weights(2 * inter, hidden), weights(hidden, inter)
    x = torch.randn(tokens, hidden, generator=g)
    ids = _routing(g, tokens, experts, top_k, offset, ragged)
    return x, ids, torch.rand(tokens, top_k, generator=g), gu, sgu, dn, sdn


def _agrees(got, x, ids, tw, gu, sgu, dn, sdn, group: int, offset: int = 0) -> bool:
    return experts_agree(got, x, ids, tw, dequantize_int4_ref(gu, sgu, group), dequantize_int4_ref(dn, sdn, group),
                         offset)  # fmt: skip


def _close(got, *case, group: int, offset: int = 0) -> bool:
    """got is the reference's output at rtol 1e-4 (only summation order and exp's implementation separate them)."""
    return torch.allclose(got, moe_experts_int4_ref(*case, group, offset), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 24), experts=st.integers(2, 5), top_k=st.integers(1, 4),
       shape=st.sampled_from(SHAPES), offset=st.sampled_from([0, 3]), ragged=st.booleans(), raw=st.booleans())  # fmt: skip
def test_matches_the_reference(isa, seed, tokens, experts, top_k, shape, offset, ragged, raw) -> None:
    group, hidden, inter = shape
    top_k = min(top_k, experts) if ragged else top_k
    case = _case(seed, tokens, experts, top_k, hidden, inter, group, offset, ragged, raw)
    got = torch.ops.mtp.moe_experts_int4(*case, group, offset)
    assert got.dtype == torch.float32 and got.shape == case[0].shape
    assert _agrees(got, *case, group=group, offset=offset)
    assert _close(got, *case, group=group, offset=offset)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_ragged_routing_at_every_row_count(isa) -> None:
    """1..24 tokens of one batch, top-8 of 10 experts (the first chosen by every token, the last by none), group 40
    (a masked / scalar tail in every group): each count is its rows of the 24-token batch bit for bit (a decode row
    equals the same row inside a verify), which agrees with the reference."""
    x, ids, tw, gu, sgu, dn, sdn = _case(8, 24, 10, 8, 160, 120, 40, ragged=True)
    assert bool((ids[:, 0] == 0).all()) and not bool((ids == 9).any())
    full = torch.ops.mtp.moe_experts_int4(x, ids, tw, gu, sgu, dn, sdn, 40, 0)
    assert _agrees(full, x, ids, tw, gu, sgu, dn, sdn, 40)
    for m in (1, 2, 3, 4, 5, 9, 17, 23):
        assert torch.equal(torch.ops.mtp.moe_experts_int4(x[:m], ids[:m], tw[:m], gu, sgu, dn, sdn, 40, 0), full[:m])
    one = torch.ops.mtp.moe_experts_int4(x[13:14], ids[13:14], tw[13:14], gu, sgu, dn, sdn, 40, 0)
    assert torch.equal(one[0], full[13])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("which,expert,row,grp", [("gate_up", 0, 0, 0), ("gate_up", 1, 119, 4), ("gate_up", 2, 120, 2),
                                                  ("gate_up", 2, 239, 4), ("down", 0, 3, 0), ("down", 1, 128, 1),
                                                  ("down", 2, 199, 2)])  # fmt: skip
def test_a_planted_wrong_scale_is_caught(isa, which, expert, row, grp) -> None:
    """hidden 200, inter 120, group 40: gate rows 0-119, up rows 120-239 (the first, the last of each) in 5 groups,
    down rows across its 128-row blocks in 3 groups; one group's scale 5% off in the first, a middle or the last
    expert fails the reference comparison: a kernel that applied a neighbouring group's, row's or expert's scale
    would."""
    case = list(_case(5, 12, 3, 2, 200, 120, 40))
    x, ids, tw, gu, sgu, dn, sdn = case
    ids[:3] = torch.tensor([[0, 1], [1, 2], [2, 0]])  # every expert has tokens
    good = torch.ops.mtp.moe_experts_int4(*case, 40, 0)
    assert _agrees(good, *case, group=40) and _close(good, *case, group=40)
    sgu2, sdn2 = sgu.clone(), sdn.clone()
    (sgu2 if which == "gate_up" else sdn2)[expert, row, grp] *= 1.05
    got = torch.ops.mtp.moe_experts_int4(x, ids, tw, gu, sgu2, dn, sdn2, 40, 0)
    assert not _close(got, *case, group=40)
    assert _close(got, x, ids, tw, gu, sgu2, dn, sdn2, group=40) and _agrees(got, x, ids, tw, gu, sgu2, dn, sdn2, 40)


def test_quantize_int4_scales_each_experts_groups_on_their_own() -> None:
    """An expert stack [E, N, K] quantizes as each expert's [N, K] alone (one expert scaled up 1000x changes only its
    own scales): [E, N, K/2] bytes and [E, N, K/G] scales, the dequantization per expert the 2-D one."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 20, 64, generator=g) * 0.05
    w[1] *= 1000
    q, s = quantize_int4(w, 16)
    assert q.shape == (3, 20, 32) and q.dtype == torch.uint8 and s.shape == (3, 20, 4) and q.is_contiguous()
    for e in range(3):
        qe, se = quantize_int4(w[e], 16)
        assert torch.equal(q[e], qe) and torch.equal(s[e], se)
        assert torch.equal(dequantize_int4_ref(q, s, 16)[e], dequantize_int4_ref(qe, se, 16))


def test_the_fake_and_the_cpu_kernel() -> None:
    x, ids, tw, gu, sgu, dn, sdn = _case(2, 4, 2, 2, 64, 32, 16)
    meta = [t.to("meta") for t in (x, ids, tw, gu, sgu, dn, sdn)]
    y = torch.ops.mtp.moe_experts_int4(*meta, 16, 0)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.device.type == "meta"
    dump = torch._C._dispatch_dump("mtp::moe_experts_int4")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/moe_experts.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


@pytest.mark.parametrize("args,group,match", [
    (lambda a: (a[0].double(), *a[1:]), 16, "x must be an fp32 CPU tensor"),
    (lambda a: (*a[:3], a[3].view(torch.int8), *a[4:]), 16, "w_gate_up and w_down must both be uint8 .packed int4"),
    (lambda a: (*a[:3], a[3][:, :, :-1], *a[4:]), 16, r"w_gate_up must be contiguous \[E, 2\*I, 32\]"),
    (lambda a: (*a[:5], a[5][:, :, :-1], a[6]), 16, r"w_down must be contiguous \[2, 64, 16\]"),
    (lambda a: a, 12, r"group_size must be a positive even divisor of H = 64 .quantize_int4's group., got 12"),
    (lambda a: a, 3, r"group_size must be a positive even divisor of H = 64"),
    (lambda a: a, 64, r"I = 32 .w_gate_up.size\(1\) / 2. is not a multiple of group_size 64"),
    (lambda a: (*a[:4], a[4][:, :, :1], *a[5:]), 16,
     r"w_gate_up_scale must be fp32 \[2, 64, 4\] \(one per group_size input features of each row of w_gate_up\)"),
    (lambda a: (*a[:6], a[6].double()), 16, r"w_down_scale must be fp32 \[2, 64, 2\]"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, group, match) -> None:
    a = _case(2, 4, 2, 2, 64, 32, 16)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.moe_experts_int4(*args(a), group, 0)
    assert len(str(e.value).strip().splitlines()) == 1
