"""mtp::moe_experts_int8 (plugins/csrc/moe_experts.cpp): the routed experts over `mtp-build --quantize int8`'s expert
weights (int8 with one fp32 scale per output row of each expert; plugins/reference.py quantize_int8), against
plugins/reference.py moe_experts_int8_ref.

On every instruction set this CPU has, 0-32 tokens, top-k 1-4, routings where some pairs' experts are held elsewhere,
one expert is chosen by every token and another by none. Two checks: test_moe_experts_fp8.py's bound (experts_agree:
first-order fp32 rounding propagated in fp64 from the same dequantized weights, which sees one down row's scale 5%
off) and closeness to the reference at rtol 1e-4 (which also sees one gate or up row's scale 5% off: that error
spreads over the down projection's sum, below the bound's reach; test_a_planted_wrong_scale_is_caught). The int8
tiles themselves are linear_int8's (common.h), checked value by value in tests/plugins/test_linear_int8.py.
Thread-count invariance: tests/plugins/test_cpp_ops.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401  (the fake)
from plugins.reference import dequantize_int8_ref, moe_experts_int8_ref, quantize_int8
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512
from tests.plugins.test_moe_experts_fp8 import experts_agree

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


def _routing(g: torch.Generator, tokens: int, experts: int, top_k: int, offset: int, ragged: bool) -> torch.Tensor:
    """[tokens, top_k] global ids. Not ragged: any id in offset-1 .. offset+experts (some held elsewhere, repeats
    allowed). Ragged: every token's first slot is the first local expert, the others distinct among the middle experts
    and one held elsewhere; the last local expert is chosen by no token."""
    if not ragged:
        return torch.randint(offset - 1, offset + experts + 1, (tokens, top_k), generator=g)
    others = torch.tensor([offset - 1] + [offset + e for e in range(1, experts - 1)])
    rows = [torch.cat([torch.tensor([offset]), others[torch.randperm(len(others), generator=g)[: top_k - 1]]])
            for _ in range(tokens)]  # fmt: skip
    return torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)


def _case(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, offset: int = 0,
          ragged: bool = False):  # fmt: skip
    """Float experts quantized as the builder quantizes them (each expert's rows on their own)."""
    g = torch.Generator().manual_seed(seed)
    gu, sgu = quantize_int8(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.08)
    dn, sdn = quantize_int8(torch.randn(experts, hidden, inter, generator=g) * 0.08)
    x = torch.randn(tokens, hidden, generator=g)
    ids = _routing(g, tokens, experts, top_k, offset, ragged)
    return x, ids, torch.rand(tokens, top_k, generator=g), gu, sgu, dn, sdn


def _agrees(got, x, ids, tw, gu, sgu, dn, sdn, offset: int = 0) -> bool:
    return experts_agree(got, x, ids, tw, dequantize_int8_ref(gu, sgu), dequantize_int8_ref(dn, sdn), offset)


def _close(got, *case, offset: int = 0) -> bool:
    """got is the reference's output at rtol 1e-4 (only summation order and exp's implementation separate them)."""
    return torch.allclose(got, moe_experts_int8_ref(*case, offset), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 32), experts=st.integers(2, 6), top_k=st.integers(1, 4),
       hidden=st.sampled_from([1, 24, 128, 160, 300]), inter=st.sampled_from([8, 128, 136, 260]),
       offset=st.sampled_from([0, 3]), ragged=st.booleans())  # fmt: skip
def test_matches_the_reference(isa, seed, tokens, experts, top_k, hidden, inter, offset, ragged) -> None:
    top_k = min(top_k, experts) if ragged else top_k
    x, ids, tw, gu, sgu, dn, sdn = _case(seed, tokens, experts, top_k, hidden, inter, offset, ragged)
    got = torch.ops.mtp.moe_experts_int8(x, ids, tw, gu, sgu, dn, sdn, offset)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _agrees(got, x, ids, tw, gu, sgu, dn, sdn, offset)
    assert _close(got, x, ids, tw, gu, sgu, dn, sdn, offset=offset)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_ragged_routing_at_every_row_count(isa) -> None:
    """1..32 tokens of one batch, top-8 of 10 experts (the first chosen by every token, the last by none): each count
    agrees with the reference, and a token's output is its row of the 32-token batch bit for bit (a decode row equals
    the same row inside a verify)."""
    x, ids, tw, gu, sgu, dn, sdn = _case(8, 32, 10, 8, 160, 136, ragged=True)
    assert bool((ids[:, 0] == 0).all()) and not bool((ids == 9).any())
    full = torch.ops.mtp.moe_experts_int8(x, ids, tw, gu, sgu, dn, sdn, 0)
    assert _agrees(full, x, ids, tw, gu, sgu, dn, sdn)
    for m in range(1, 33):
        assert torch.equal(torch.ops.mtp.moe_experts_int8(x[:m], ids[:m], tw[:m], gu, sgu, dn, sdn, 0), full[:m])
    for t in (0, 13, 31):
        one = torch.ops.mtp.moe_experts_int8(x[t : t + 1], ids[t : t + 1], tw[t : t + 1], gu, sgu, dn, sdn, 0)
        assert torch.equal(one[0], full[t])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("which,expert,row", [("gate_up", 0, 0), ("gate_up", 1, 135), ("gate_up", 2, 136),
                                              ("gate_up", 1, 271), ("down", 0, 3), ("down", 1, 128),
                                              ("down", 2, 299)])  # fmt: skip
def test_a_planted_wrong_scale_is_caught(isa, which, expert, row) -> None:
    """hidden 300, inter 136: gate rows 0-135, up rows 136-271 (the first, the last gate row, the first, the last up
    row), down rows across its 128-row blocks; one row's scale 5% off in the first, a middle or the last expert fails
    the reference comparison (and, in down, the bound): a kernel that applied a neighbouring row's (or expert's)
    scale would."""
    x, ids, tw, gu, sgu, dn, sdn = _case(5, 12, 3, 2, 300, 136)
    ids[:3] = torch.tensor([[0, 1], [1, 2], [2, 0]])  # every expert has tokens
    good = torch.ops.mtp.moe_experts_int8(x, ids, tw, gu, sgu, dn, sdn, 0)
    assert _agrees(good, x, ids, tw, gu, sgu, dn, sdn) and _close(good, x, ids, tw, gu, sgu, dn, sdn)
    sgu2, sdn2 = sgu.clone(), sdn.clone()
    (sgu2 if which == "gate_up" else sdn2)[expert, row] *= 1.05
    got = torch.ops.mtp.moe_experts_int8(x, ids, tw, gu, sgu2, dn, sdn2, 0)
    assert not _close(got, x, ids, tw, gu, sgu, dn, sdn)
    assert _close(got, x, ids, tw, gu, sgu2, dn, sdn2) and _agrees(got, x, ids, tw, gu, sgu2, dn, sdn2)
    if which == "down":
        assert not _agrees(got, x, ids, tw, gu, sgu, dn, sdn)


def test_quantize_int8_scales_each_experts_rows_on_their_own() -> None:
    """The experts' quantization is the linears' per expert matrix: [E, N, K] gives [E, N] scales, each expert's equal
    to quantize_int8 of that expert alone (one expert scaled up 1000x changes only its own scales), and the
    dequantization per expert is the 2-D one."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 20, 33, generator=g) * 0.05
    w[1] *= 1000
    q, s = quantize_int8(w)
    assert q.shape == w.shape and q.dtype == torch.int8 and s.shape == (3, 20) and q.is_contiguous()
    for e in range(3):
        qe, se = quantize_int8(w[e])
        assert torch.equal(q[e], qe) and torch.equal(s[e], se)
        assert torch.equal(dequantize_int8_ref(q, s)[e], dequantize_int8_ref(qe, se))


def test_the_fake_and_the_cpu_kernel() -> None:
    x, ids, tw, gu, sgu, dn, sdn = _case(2, 4, 2, 2, 40, 24)
    meta = [t.to("meta") for t in (x, ids, tw, gu, sgu, dn, sdn)]
    y = torch.ops.mtp.moe_experts_int8(*meta, 0)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.device.type == "meta"
    dump = torch._C._dispatch_dump("mtp::moe_experts_int8")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/moe_experts.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


@pytest.mark.parametrize("args,match", [
    (lambda a: (a[0].double(), *a[1:]), "x must be an fp32 CPU tensor"),
    (lambda a: (*a[:3], a[3].float(), *a[4:]), "w_gate_up and w_down must both be int8, got Float and Char"),
    (lambda a: (*a[:5], a[5].view(torch.uint8), a[6]), "w_gate_up and w_down must both be int8, got Char and Byte"),
    (lambda a: (*a[:3], a[3][:, :-1], *a[4:]), r"w_gate_up must be contiguous \[E, 2\*I, 40\]"),
    (lambda a: (*a[:5], a[5][:, :, :-1], a[6]), r"w_down must be contiguous \[2, 40, 24\]"),
    (lambda a: (*a[:4], a[4][:, :1], *a[5:]), r"w_gate_up_scale must be fp32 \[2, 48\] \(one per row of w_gate_up\)"),
    (lambda a: (*a[:4], a[4].double(), *a[5:]), r"w_gate_up_scale must be fp32"),
    (lambda a: (*a[:6], a[6][:1]), r"w_down_scale must be fp32 \[2, 40\] \(one per row of w_down\)"),
    (lambda a: (a[0], a[1][:, :1], *a[2:]), r"topk_ids and topk_weights must be \[4, K\]"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, match) -> None:
    a = _case(2, 4, 2, 2, 40, 24)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.moe_experts_int8(*args(a), 0)
    assert len(str(e.value).strip().splitlines()) == 1
