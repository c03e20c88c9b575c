"""mtp::linear_int8 (plugins/csrc/linear_int8.cpp): fp32 activations times a weight-only int8 weight with one fp32 scale
per output channel, read as bytes, converted in registers, fp32 math, against plugins/reference.py linear_int8_ref; and
quantize_int8, the one quantizer (the builder's too).

On every instruction set this CPU has (portable, AVX2, AVX-512), for the few-row path (decode / verify / draft, M < 16)
and the dequantized-tile MKL path (prefill chunks), with N and K that leave partial vector chunks and weight-row tiles.
The tolerance is test_linear_fp8.py's: the kernel and the reference use the same dequantized fp32 weights (each q * s
rounded once), so only the fp32 summation order separates them; the reference sums in fp64 and the bound is
4 * K * eps * sum|x * w| (+ |b| eps). It catches one row's scale 5% off (test_a_planted_wrong_scale_is_caught), and
one-hot activations check every int8 value times its row's scale bit for bit, with no summation at all."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401  (the fake)
from plugins.reference import dequantize_int8_ref, linear_int8_ref, quantize_int8
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


def _scales(g: torch.Generator, n: int) -> torch.Tensor:
    """Positive scales over several binades, like max|w| / 127 of real rows (1e-5 .. 1e-1)."""
    return torch.exp(torch.empty(n).uniform_(-11.5, -2.3, generator=g))


def _case(seed: int, m: int, n: int, k: int, bias: bool):
    """Every int8 value, -128 included (the quantizer never makes it, the kernel must still read it right)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return x, w, _scales(g, n), torch.randn(n, generator=g) if bias else None


def _agrees(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> bool:
    """got equals x @ dequant(w, s)^T + b up to fp32 summation order."""
    deq = dequantize_int8_ref(w, s).double()
    want = x.double() @ deq.T + (0 if b is None else b.double())
    eps = torch.finfo(torch.float32).eps
    bound = 4 * x.shape[-1] * eps * (x.abs().double() @ deq.abs().T) + (0 if b is None else b.abs().double() * eps)
    return bool(((got.double() - want).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), m=st.integers(1, 33), n=st.integers(1, 300), k=st.integers(1, 300),
       bias=st.booleans())  # fmt: skip
def test_matches_the_reference(isa: str, seed: int, m: int, n: int, k: int, bias: bool) -> None:
    x, w, s, b = _case(seed, m, n, k, bias)
    got = torch.ops.mtp.linear_int8(x, w, s, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert _agrees(got, x, w, s, b)
    want = linear_int8_ref(x, w, s, b)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-30)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", [(256, 2), (5, 130), (130, 260), (3, 19)])
def test_every_int8_value_is_exact(isa: str, n: int, k: int) -> None:
    """One-hot activations pick single weights: no summation, so y == q * s[row] bit for bit, for all 256 values in
    every position of the vector loops (full chunks, 8-column steps, tails) and of the 4-row tiles, on both the
    few-row (<= 15 rows) and the tiled (16+ rows) paths."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = ((torch.arange(n * k, dtype=torch.int64) % 256) - 128).to(torch.int8).view(n, k)
    w = w[:, torch.randperm(k, generator=g)].contiguous()
    s = _scales(g, n)
    deq = dequantize_int8_ref(w, s)
    for rows in (torch.arange(min(k, 15)), torch.arange(k)):
        x = torch.zeros(len(rows), k)
        x[torch.arange(len(rows)), rows] = 1.0
        got = torch.ops.mtp.linear_int8(x, w, s, None)
        assert torch.equal(got, deq.T[rows])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("row", [0, 3, 4, 63, 64, 298, 299])
def test_a_planted_wrong_scale_is_caught(isa: str, m: int, row: int) -> None:
    """The agreement check sees one row's scale 5% off (with one activation row, this data needs 1.1% at the least),
    in any place of a 4-row tile, of a 64-row task and the tail rows: a kernel that applied a neighbouring row's scale
    (or one scale to a whole tile) fails it."""
    x, w, s, b = _case(11, m, 300, 300, True)
    assert _agrees(torch.ops.mtp.linear_int8(x, w, s, b), x, w, s, b)
    planted = s.clone()
    planted[row] *= 1.05
    got = torch.ops.mtp.linear_int8(x, w, planted, b)
    assert not _agrees(got, x, w, s, b)
    assert _agrees(got, x, w, planted, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_row_does_not_depend_on_the_batch(isa: str) -> None:
    """Below the tiled path every row runs the same operations whatever the row count: decode == verify rows."""
    x, w, s, b = _case(1, 15, 137, 333, True)
    full = torch.ops.mtp.linear_int8(x, w, s, b)
    for m in (1, 2, 3, 4, 5, 8):
        assert torch.equal(torch.ops.mtp.linear_int8(x[:m], w, s, b), full[:m])
        assert torch.equal(torch.ops.mtp.linear_int8(x[m : 2 * m], w, s, b), full[m : 2 * m])


@pytest.mark.parametrize("m", [1, 3, 20])
def test_threads_do_not_change_the_result(m: int) -> None:
    """at::parallel_for splits output features (few rows) or tile rows (many): each value is computed by the same
    operations whatever thread runs it."""
    x, w, s, b = _case(5, m, 1000, 384, True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.mtp.linear_int8(x, w, s, b)
        torch.set_num_threads(2)
        two = torch.ops.mtp.linear_int8(x, w, s, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert _agrees(one, x, w, s, b)


def test_leading_dims_strided_activations_and_scale() -> None:
    x, w, s, b = _case(2, 12, 9, 140, True)
    want = torch.ops.mtp.linear_int8(x, w, s, b)
    got = torch.ops.mtp.linear_int8(x.view(3, 4, 140), w, s, b)
    assert got.shape == (3, 4, 9) and torch.equal(got.view(12, 9), want)
    wide = torch.randn(12, 280)
    wide[:, ::2] = x
    assert torch.equal(torch.ops.mtp.linear_int8(wide[:, ::2], w, s, b), want)
    strided_s = torch.zeros(18)
    strided_s[::2] = s
    assert torch.equal(torch.ops.mtp.linear_int8(x, w, strided_s[::2], b), want)
    assert torch.equal(torch.ops.mtp.linear_int8(x, w, s, None) + b, want)  # the bias is added once, in fp32
    assert torch.ops.mtp.linear_int8(x[:0], w, s, b).shape == (0, 9)
    empty_k = torch.ops.mtp.linear_int8(torch.ones(2, 0), w[:, :0], s, b)
    assert torch.equal(empty_k, b.expand(2, 9))


@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (64, 4096)])
def test_quantize_int8(shape: tuple[int, int]) -> None:
    """Symmetric per row: the row's largest magnitude maps to +-127 exactly, every element within half a step, -128
    never made, an all-zero row exactly zero again (scale 1), and the quantized linear close to the float one."""
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=g) * 0.02
    w[0] = 0.0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (shape[0],)
    assert q.is_contiguous() and int(q.min()) >= -127
    assert s[0] == 1.0 and not q[0].any()
    assert torch.equal(q[1:].abs().amax(dim=1), torch.full((shape[0] - 1,), 127, dtype=torch.int8))
    deq = dequantize_int8_ref(q, s)
    assert bool(((deq - w).abs() <= s[:, None] * (0.5 + 1e-5)).all())
    x = torch.randn(3, shape[1], generator=g)
    exact = x.double() @ w.double().T
    step = (x.abs().double() @ torch.ones_like(w).double().T) * s.double() / 2  # sum |x| * half a step
    assert bool(((torch.ops.mtp.linear_int8(x, q, s, None).double() - exact).abs() <= step + 1e-6).all())


def test_the_cpu_kernel_is_the_cpp_library() -> None:
    dump = torch._C._dispatch_dump("mtp::linear_int8")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/linear_int8.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


def test_fake() -> None:
    """The shape rule torch.export traces with (meta tensors run the fake)."""
    x = torch.empty(2, 3, 130, device="meta")
    w = torch.empty(5, 130, dtype=torch.int8, device="meta")
    y = torch.ops.mtp.linear_int8(x, w, torch.empty(5, device="meta"), None)
    assert y.shape == (2, 3, 5) and y.dtype == torch.float32


@pytest.mark.parametrize("args,match", [
    (lambda x, w, s, b: (x.double(), w, s, b), "x must be fp32"),
    (lambda x, w, s, b: (x, w.float(), s, b), r"weight must be a 2-D int8 tensor \[N, K\], got Float"),
    (lambda x, w, s, b: (x, w.view(torch.uint8), s, b), "weight must be a 2-D int8 tensor"),
    (lambda x, w, s, b: (x, w[None], s, b), "weight must be a 2-D int8 tensor"),
    (lambda x, w, s, b: (x, torch.zeros(136, 200, dtype=torch.int8).t(), s, b), "weight must be contiguous"),
    (lambda x, w, s, b: (x, w, s[:3], b), r"scale must be fp32 \[200\]"),
    (lambda x, w, s, b: (x, w, s.double(), b), r"scale must be fp32 \[200\]"),
    (lambda x, w, s, b: (x, w, s[None], b), r"scale must be fp32 \[200\]"),
    (lambda x, w, s, b: (x[:, :5], w, s, b), r"x must be \[\.\.\., 136\]"),
    (lambda x, w, s, b: (x, w, s, b[:3]), r"bias must be an fp32 CPU tensor \[200\]"),
    (lambda x, w, s, b: (x, w, s, b.bfloat16()), "bias must be an fp32"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, match) -> None:
    x, w, s, b = _case(3, 4, 200, 136, True)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.linear_int8(*args(x, w, s, b))
    assert len(str(e.value).strip().splitlines()) == 1
