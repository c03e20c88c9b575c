"""mtp::moe_experts_fp8 (plugins/csrc/moe_experts.cpp): the routed experts over FP8 expert weights as released (e4m3 +
128x128 block scales; gate and up each blocked on their own), against plugins/reference.py moe_experts_fp8_ref.

On every instruction set this CPU has. The tolerance is a first-order bound of fp32 rounding propagated through the
expert's math in fp64 from the same dequantized weights (both dot products at 4 * n * eps * sum|a * b|, SiLU at a few
ulps with |silu'| <= 1.1, the weighted slot sum): only summation order and the exp implementation separate kernel
and reference, and the bound is tight enough to catch one scale block 25% off in the gate half, the up half or the
down projection, edge blocks included (test_a_planted_wrong_scale_is_caught). The byte conversion itself is the
FP8 tile code linear_fp8 shares, checked byte by byte in tests/plugins/test_linear_fp8.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401  (the fake)
from models.fp8 import quantize
from plugins.reference import dequantize_fp8_experts_ref, moe_experts_fp8_ref
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
EPS = torch.finfo(torch.float32).eps


def _experts(g: torch.Generator, e: int, rows: int, cols: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[e, parts * rows, cols] e4m3 and its scales, each part quantized on its own as the releases do."""
    qs, ss = [], []
    for _ in range(e):
        pieces = [quantize(torch.randn(rows, cols, generator=g) * 0.08) for _ in range(parts)]
        qs.append(torch.cat([q for q, _ in pieces]))
        ss.append(torch.cat([s for _, s in pieces]))
    return torch.stack(qs), torch.stack(ss)


def _case(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, offset: int = 0):
    g = torch.Generator().manual_seed(seed)
    gu, sgu = _experts(g, experts, inter, hidden, 2)
    dn, sdn = _experts(g, experts, hidden, inter, 1)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(offset - 1, offset + experts + 1, (tokens, top_k), generator=g)  # some held elsewhere
    return x, ids, torch.rand(tokens, top_k, generator=g), gu, sgu, dn, sdn


def _agrees(got, x, ids, tw, gu, sgu, dn, sdn, offset: int = 0) -> bool:
    """got equals the experts' output up to fp32 rounding (a bound propagated in fp64); NaN where it is NaN."""
    return experts_agree(got, x, ids, tw, dequantize_fp8_experts_ref(gu, sgu, 2), dequantize_fp8_experts_ref(dn, sdn),
                         offset)  # fmt: skip


def experts_agree(got, x, ids, tw, w_gu, w_dn, offset: int = 0) -> bool:
    """got equals the output of the experts whose dequantized weights are w_gu [E, 2I, H] / w_dn [E, H, I] up to fp32
    rounding (the module docstring's bound, propagated in fp64); NaN where it is NaN. test_moe_experts_int8.py's
    check too."""
    w_gu, w_dn = w_gu.double(), w_dn.double()
    hidden, inter = x.shape[1], w_dn.shape[2]
    want = torch.zeros(x.shape, dtype=torch.float64)
    bound = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        terms = []
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - offset
            if not 0 <= e < w_gu.shape[0]:
                continue
            xt = x[t].double()
            g, u = (w_gu[e] @ xt).split(inter)
            eg, eu = (4 * hidden * EPS * (w_gu[e].abs() @ xt.abs())).split(inter)
            sg = torch.nn.functional.silu(g)
            h = sg * u
            eh = u.abs() * (1.1 * eg + 8 * EPS * sg.abs()) + sg.abs() * eu + 2 * EPS * h.abs()
            y = w_dn[e] @ h
            ey = w_dn[e].abs() @ eh + 4 * inter * EPS * (w_dn[e].abs() @ h.abs())
            weight = float(tw[t, k])
            want[t] += weight * y
            bound[t] += abs(weight) * ey
            terms.append((weight * y).abs())
        if terms:
            bound[t] += 2 * len(terms) * EPS * torch.stack(terms).sum(0)
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    return bool(((got.double() - want).abs() <= bound + 1e-30)[~nan].all())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 9), experts=st.integers(1, 4), top_k=st.integers(1, 3),
       hidden=st.sampled_from([1, 24, 128, 160, 300]), inter=st.sampled_from([8, 128, 136, 260]),
       offset=st.sampled_from([0, 3]))  # fmt: skip
def test_matches_the_reference(isa, seed, tokens, experts, top_k, hidden, inter, offset) -> None:
    x, ids, tw, gu, sgu, dn, sdn = _case(seed, tokens, experts, top_k, hidden, inter, offset)
    got = torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu, sgu, dn, sdn, offset)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _agrees(got, x, ids, tw, gu, sgu, dn, sdn, offset)
    want = moe_experts_fp8_ref(x, ids, tw, gu, sgu, dn, sdn, offset)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("where", [("gate_up", (1, 0, 0)), ("gate_up", (1, 1, 2)), ("gate_up", (2, 2, 1)),
                                   ("gate_up", (0, 3, 2)), ("down", (1, 0, 0)), ("down", (2, 2, 1))])  # fmt: skip
def test_a_planted_wrong_scale_is_caught(isa, where) -> None:
    """hidden 300, inter 136: gate block rows 0-1 (the second 8 rows), up block rows 2-3, down block rows of 128 /
    128 / 44; one block 25% off (in the first expert, a middle one or the last) fails the agreement check."""
    x, ids, tw, gu, sgu, dn, sdn = _case(5, 12, 3, 2, 300, 136)
    ids[:3] = torch.tensor([[0, 1], [1, 2], [2, 0]])  # every expert has tokens
    assert _agrees(torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu, sgu, dn, sdn, 0), x, ids, tw, gu, sgu, dn, sdn)
    which, block = where
    sgu2, sdn2 = sgu.clone(), sdn.clone()
    (sgu2 if which == "gate_up" else sdn2)[block] *= 1.25
    got = torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu, sgu2, dn, sdn2, 0)
    assert not _agrees(got, x, ids, tw, gu, sgu, dn, sdn)
    assert _agrees(got, x, ids, tw, gu, sgu2, dn, sdn2)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_nan_bytes_make_their_experts_tokens_nan(isa) -> None:
    """A NaN weight (0x7f / 0xff) in expert 1, as the reference has it: in gate_up it makes h, hence every output of
    the tokens routed there NaN (whatever the routing weight); in down row r only their output r. The tokens of the
    other experts are untouched."""
    x, ids, tw, gu, sgu, dn, sdn = _case(9, 6, 3, 1, 160, 136)
    ids[:, 0] = torch.tensor([0, 1, 2, 1, 0, 2])
    for which, (e, r, c) in (("gate_up", (1, 200, 150)), ("down", (1, 159, 135))):
        w = (gu if which == "gate_up" else dn).view(torch.uint8).clone()
        w[e, r, c] = 0xFF if which == "gate_up" else 0x7F
        args = (w.view(torch.float8_e4m3fn), sgu, dn) if which == "gate_up" else (gu, sgu, w.view(torch.float8_e4m3fn))
        got = torch.ops.mtp.moe_experts_fp8(x, ids, tw, *args, sdn, 0)
        nan = got[[1, 3]].isnan()
        assert nan.all() if which == "gate_up" else nan[:, 159].all() and nan.sum() == 2
        assert not got[[0, 2, 4, 5]].isnan().any()
        assert _agrees(got, x, ids, tw, args[0], sgu, args[2], sdn)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_token_does_not_depend_on_the_batch(isa) -> None:
    x, ids, tw, gu, sgu, dn, sdn = _case(3, 9, 4, 2, 160, 136)
    full = torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu, sgu, dn, sdn, 0)
    for t in range(9):
        one = torch.ops.mtp.moe_experts_fp8(x[t : t + 1], ids[t : t + 1], tw[t : t + 1], gu, sgu, dn, sdn, 0)
        assert torch.equal(one[0], full[t])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_huge_scale_takes_the_exact_portable_path(isa) -> None:
    """|s| >= 2^120 (s * 256 would overflow the vector paths' rescaling): still the reference's values."""
    x, ids, tw, gu, sgu, dn, sdn = _case(4, 5, 2, 2, 160, 136)
    sdn2 = sdn.clone()
    sdn2[0, 1, 0] = 2.0**121
    xs = x * 2.0**-100
    got = torch.ops.mtp.moe_experts_fp8(xs, ids, tw, gu, sgu, dn, sdn2, 0)
    assert _agrees(got, xs, ids, tw, gu, sgu, dn, sdn2)


def test_uint8_bits_and_the_fake() -> None:
    x, ids, tw, gu, sgu, dn, sdn = _case(2, 4, 2, 2, 40, 24)
    want = torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu, sgu, dn, sdn, 0)
    got = torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu.view(torch.uint8), sgu, dn.view(torch.uint8), sdn, 0)
    assert torch.equal(got, want)
    meta = [t.to("meta") for t in (x, ids, tw, gu, sgu, dn, sdn)]
    y = torch.ops.mtp.moe_experts_fp8(*meta, 0)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.device.type == "meta"


def test_the_cpu_kernel_is_the_cpp_library() -> None:
    dump = torch._C._dispatch_dump("mtp::moe_experts_fp8")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/moe_experts.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


@pytest.mark.parametrize("args,match", [
    (lambda a: (a[0].double(), *a[1:]), "x must be an fp32 CPU tensor"),
    (lambda a: (*a[:3], a[3].float(), *a[4:]), "w_gate_up and w_down must both be float8_e4m3fn"),
    (lambda a: (*a[:5], a[5].view(torch.uint8), a[6]), "w_gate_up and w_down must both be float8_e4m3fn"),
    (lambda a: (*a[:3], a[3][:, :-1], *a[4:]), r"w_gate_up must be contiguous \[E, 2\*I, 40\]"),
    (lambda a: (*a[:5], a[5][:, :, :-1], a[6]), r"w_down must be contiguous \[2, 40, 24\]"),
    (lambda a: (*a[:4], a[4][:, :1], *a[5:]), r"w_gate_up_scale must be fp32 \[2, 2, 1\]"),
    (lambda a: (*a[:4], a[4].double(), *a[5:]), r"w_gate_up_scale must be fp32"),
    (lambda a: (*a[:6], a[6][:1]), r"w_down_scale must be fp32 \[2, 1, 1\]"),
    (lambda a: (a[0], a[1][:, :1], *a[2:]), r"topk_ids and topk_weights must be \[4, K\]"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, match) -> None:
    a = _case(2, 4, 2, 2, 40, 24)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.moe_experts_fp8(*args(a), 0)
    assert len(str(e.value).strip().splitlines()) == 1
