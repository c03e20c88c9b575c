"""mtp::linear_int4 (plugins/csrc/linear_int4.cpp): fp32 activations times a group-wise weight-only int4 weight (two
values per byte, one fp32 scale per group of input features), unpacked in registers, fp32 math, against
plugins/reference.py linear_int4_ref; and quantize_int4 / pack_int4, the one definition of the format.

test_linear_int8.py's properties: on every instruction set this CPU has (portable, AVX2, AVX-512), for the few-row
path (decode / verify / draft, M < 16) and the dequantized-tile MKL path (prefill chunks), with N that leave partial
weight-row tiles and group sizes (2, 6, 16, 32) whose groups end inside a vector chunk, so K need not be a multiple of
the vector width. The tolerance is test_linear_int8.py's: kernel and reference use the same dequantized fp32 weights
(each q * s rounded once), so only the fp32 summation order separates them; the reference sums in fp64 and the bound
is 4 * K * eps * sum|x * w| (+ |b| eps). It catches one group's scale 5% off, and one-hot activations check every
int4 value times its group's scale bit for bit, with no summation at all."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401  (the fake)
from plugins.reference import dequantize_int4_ref, linear_int4_ref, pack_int4, quantize_int4, unpack_int4
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


def _scales(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Positive scales over several binades, like max|group| / 7 of real weights (1e-5 .. 1e-1)."""
    return torch.exp(torch.empty(shape).uniform_(-11.5, -2.3, generator=g))


def _case(seed: int, m: int, n: int, k: int, group: int, bias: bool):
    """Every int4 value, -8 included (the quantizer never makes it, the kernel must still read it right)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    return x, pack_int4(q), _scales(g, (n, k // group)), torch.randn(n, generator=g) if bias else None


def _agrees(got, x, w, s, group, b) -> bool:
    """got equals x @ dequant(w, s)^T + b up to fp32 summation order."""
    deq = dequantize_int4_ref(w, s, group).double()
    want = x.double() @ deq.T + (0 if b is None else b.double())
    eps = torch.finfo(torch.float32).eps
    bound = 4 * x.shape[-1] * eps * (x.abs().double() @ deq.abs().T) + (0 if b is None else b.abs().double() * eps)
    return bool(((got.double() - want).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), m=st.integers(1, 33), n=st.integers(1, 300), group=st.sampled_from([2, 6, 16, 32]),
       groups=st.integers(1, 10), bias=st.booleans())  # fmt: skip
def test_matches_the_reference(isa: str, seed: int, m: int, n: int, group: int, groups: int, bias: bool) -> None:
    k = group * groups
    x, w, s, b = _case(seed, m, n, k, group, bias)
    got = torch.ops.mtp.linear_int4(x, w, s, group, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert _agrees(got, x, w, s, group, b)
    want = linear_int4_ref(x, w, s, group, b)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-30)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k,group", [(16, 32, 32), (5, 96, 32), (130, 160, 32), (3, 42, 6), (7, 24, 2)])
def test_every_int4_value_is_exact(isa: str, n: int, k: int, group: int) -> None:
    """One-hot activations pick single weights: no summation, so y == q * s[row, group] bit for bit, for all 16 values
    in every position of the vector loops (16- and 8-column steps, masked and scalar group tails) and of the weight-row
    tiles, on both the few-row (<= 15 rows) and the tiled (16+ rows) paths."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    q = ((torch.arange(n * k, dtype=torch.int64) % 16) - 8).to(torch.int8).view(n, k)
    q = q[:, torch.randperm(k, generator=g)].contiguous()
    w, s = pack_int4(q), _scales(g, (n, k // group))
    deq = dequantize_int4_ref(w, s, group)
    assert torch.equal(unpack_int4(w), q)
    for rows in (torch.arange(min(k, 15)), torch.arange(k)):
        x = torch.zeros(len(rows), k)
        x[torch.arange(len(rows)), rows] = 1.0
        got = torch.ops.mtp.linear_int4(x, w, s, group, None)
        assert torch.equal(got, deq.T[rows])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("row,grp", [(0, 0), (3, 9), (4, 5), (63, 1), (64, 0), (298, 9), (299, 4)])
def test_a_planted_wrong_scale_is_caught(isa: str, m: int, row: int, grp: int) -> None:
    """The agreement check sees one group's scale 5% off in any place of a 4-row tile, of a 64-row task, of the tail
    rows and of the row's groups: a kernel that applied a neighbouring row's or group's scale fails it. The planted
    group's activations are 100x the others' (all still take part): one group of ten is a tenth of a dot product, and
    its partial sum can cancel to well below the check's bound (4 K eps sum|x w|), where no 5% error is visible; and a
    row's group scales are within a factor 2 of each other, as in real weights (not _case's 1e-5 .. 1e-1). With these
    the smallest error the check sees is 0.75% (the worst case here)."""
    x, w, s, b = _case(11, m, 300, 320, 32, True)
    s = s[:, :1] * torch.empty(s.shape).uniform_(0.5, 1.0, generator=torch.Generator().manual_seed(12))
    x[:, : grp * 32] *= 0.01
    x[:, (grp + 1) * 32 :] *= 0.01
    assert _agrees(torch.ops.mtp.linear_int4(x, w, s, 32, b), x, w, s, 32, b)
    planted = s.clone()
    planted[row, grp] *= 1.05
    got = torch.ops.mtp.linear_int4(x, w, planted, 32, b)
    assert not _agrees(got, x, w, s, 32, b)
    assert _agrees(got, x, w, planted, 32, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_row_does_not_depend_on_the_batch(isa: str) -> None:
    """Below the tiled path every row runs the same operations whatever the row count: a decode row equals the same
    row inside any verify / draft batch of up to 15 rows, bit for bit."""
    x, w, s, b = _case(1, 15, 137, 352, 32, True)
    full = torch.ops.mtp.linear_int4(x, w, s, 32, b)
    for m in range(1, 16):
        assert torch.equal(torch.ops.mtp.linear_int4(x[:m], w, s, 32, b), full[:m])
        assert torch.equal(torch.ops.mtp.linear_int4(x[15 - m :], w, s, 32, b), full[15 - m :])
    for r in range(15):
        assert torch.equal(torch.ops.mtp.linear_int4(x[r : r + 1], w, s, 32, b), full[r : r + 1])


@pytest.mark.parametrize("m", [1, 3, 20])
def test_threads_do_not_change_the_result(m: int) -> None:
    """at::parallel_for splits output features (few rows) or tile rows (many): each value is computed by the same
    operations whatever thread runs it. K = 768: at M = 1 that is enough work for grain_for to give both threads a
    share (384 would run inline)."""
    x, w, s, b = _case(5, m, 1000, 768, 32, True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.mtp.linear_int4(x, w, s, 32, b)
        torch.set_num_threads(2)
        two = torch.ops.mtp.linear_int4(x, w, s, 32, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert _agrees(one, x, w, s, 32, b)


def test_leading_dims_strided_activations_and_scale() -> None:
    x, w, s, b = _case(2, 12, 9, 160, 32, True)
    want = torch.ops.mtp.linear_int4(x, w, s, 32, b)
    got = torch.ops.mtp.linear_int4(x.view(3, 4, 160), w, s, 32, b)
    assert got.shape == (3, 4, 9) and torch.equal(got.view(12, 9), want)
    wide = torch.randn(12, 320)
    wide[:, ::2] = x
    assert torch.equal(torch.ops.mtp.linear_int4(wide[:, ::2], w, s, 32, b), want)
    strided_s = torch.zeros(9, 10)
    strided_s[:, ::2] = s
    assert torch.equal(torch.ops.mtp.linear_int4(x, w, strided_s[:, ::2], 32, b), want)
    assert torch.equal(torch.ops.mtp.linear_int4(x, w, s, 32, None) + b, want)  # the bias is added once, in fp32
    assert torch.ops.mtp.linear_int4(x[:0], w, s, 32, b).shape == (0, 9)
    empty_k = torch.ops.mtp.linear_int4(torch.ones(2, 0), w[:, :0], s[:, :0], 32, b)
    assert torch.equal(empty_k, b.expand(2, 9))


@pytest.mark.parametrize("shape,group", [((1, 32), 32), ((7, 96), 32), ((64, 4096), 32), ((5, 42), 6)])
def test_quantize_int4(shape: tuple[int, int], group: int) -> None:
    """Symmetric per group: the group's largest magnitude maps to +-7 exactly, every element within half a step, -8
    never made, an all-zero group exactly zero again (scale 1), and the quantized linear close to the float one."""
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=g) * 0.02
    w[0, :group] = 0.0
    packed, s = quantize_int4(w, group)
    q = unpack_int4(packed)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2) and packed.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (shape[0], shape[1] // group)
    assert int(q.min()) >= -7 and s[0, 0] == 1.0 and not q[0, :group].any()
    amax = q.view(shape[0], -1, group).abs().amax(dim=-1)
    assert torch.equal(amax.flatten()[1:], torch.full((amax.numel() - 1,), 7, dtype=torch.int8))
    deq = dequantize_int4_ref(packed, s, group)
    assert bool(((deq - w).abs() <= s.repeat_interleave(group, dim=1) * (0.5 + 1e-5)).all())
    x = torch.randn(3, shape[1], generator=g)
    exact = x.double() @ w.double().T
    step = x.abs().double() @ (s.repeat_interleave(group, dim=1).double() / 2).T  # sum |x| * half a step
    assert bool(((torch.ops.mtp.linear_int4(x, packed, s, group, None).double() - exact).abs() <= step + 1e-6).all())


@pytest.mark.parametrize("group", [0, 3, 64])
def test_quantize_int4_refuses_a_group_that_does_not_divide_k(group: int) -> None:
    with pytest.raises(ValueError, match=f"group_size {group} must be a positive even divisor of K = 96"):
        quantize_int4(torch.randn(4, 96), group)


def test_the_cpu_kernel_is_the_cpp_library() -> None:
    dump = torch._C._dispatch_dump("mtp::linear_int4")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/linear_int4.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


def test_fake() -> None:
    """The shape rule torch.export traces with (meta tensors run the fake)."""
    x = torch.empty(2, 3, 128, device="meta")
    w = torch.empty(5, 64, dtype=torch.uint8, device="meta")
    y = torch.ops.mtp.linear_int4(x, w, torch.empty(5, 4, device="meta"), 32, None)
    assert y.shape == (2, 3, 5) and y.dtype == torch.float32


@pytest.mark.parametrize("args,match", [
    (lambda x, w, s, b: (x.double(), w, s, 32, b), "x must be fp32"),
    (lambda x, w, s, b: (x, w.view(torch.int8), s, 32, b), r"weight must be a 2-D uint8 tensor \[N, K/2\]"),
    (lambda x, w, s, b: (x, w.float(), s, 32, b), r"weight must be a 2-D uint8 tensor \[N, K/2\].*got Float"),
    (lambda x, w, s, b: (x, w[None], s, 32, b), "weight must be a 2-D uint8 tensor"),
    (lambda x, w, s, b: (x, torch.zeros(80, 200, dtype=torch.uint8).t(), s, 32, b), "weight must be contiguous"),
    (lambda x, w, s, b: (x, w, s, 0, b), "group_size must be a positive even number"),
    (lambda x, w, s, b: (x, w, s, 5, b), "group_size must be a positive even number"),
    (lambda x, w, s, b: (x, w, s, 48, b), r"K = 160 \(2 \* weight.size\(1\)\) is not a multiple of group_size 48"),
    (lambda x, w, s, b: (x, w, s[:, :3], 32, b), r"scale must be fp32 \[200, 5\]"),
    (lambda x, w, s, b: (x, w, s, 16, b), r"scale must be fp32 \[200, 10\]"),
    (lambda x, w, s, b: (x, w, s.double(), 32, b), r"scale must be fp32 \[200, 5\]"),
    (lambda x, w, s, b: (x, w, s[:3], 32, b), r"scale must be fp32 \[200, 5\]"),
    (lambda x, w, s, b: (x[:, :5], w, s, 32, b), r"x must be \[\.\.\., 160\]"),
    (lambda x, w, s, b: (x, w, s, 32, b[:3]), r"bias must be an fp32 CPU tensor \[200\]"),
    (lambda x, w, s, b: (x, w, s, 32, b.bfloat16()), "bias must be an fp32"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, match) -> None:
    x, w, s, b = _case(3, 4, 200, 160, 32, True)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.linear_int4(*args(x, w, s, b))
    assert len(str(e.value).strip().splitlines()) == 1
