"""mtp::linear_fp8 (plugins/csrc/linear_fp8.cpp): fp32 activations times a block-quantized float8_e4m3fn weight read
as bytes, converted in registers, fp32 math, against plugins/reference.py linear_fp8_ref.

On every instruction set this CPU has (portable, AVX2, AVX-512), for the few-row path (decode / verify / draft, M < 16)
and the dequantized-tile MKL path (prefill chunks), with N and K that leave partial 128-blocks. The tolerance: the
kernel and the reference use the same dequantized fp32 weights (each q * s rounded once), so only the fp32 summation
order of K products separates them; the reference sums in fp64 and the bound is 4 * K * eps * sum|x * w| (+ |b| eps),
linear_bf16's bound, several times the worst-case fp32 sum error. It is tight enough to catch one 128 x 128 scale
block off by 25% (test_a_planted_wrong_scale_is_caught), and one-hot activations check every e4m3 byte value
(subnormals, -0, the largest normals) bit for bit, with no summation at all."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.ops  # noqa: F401  (the fake)
from plugins.reference import dequantize_fp8_ref, linear_fp8_ref
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
NAN_BYTES = (0x7F, 0xFF)


def _bytes(g: torch.Generator, n: int, k: int, nan: bool = False) -> torch.Tensor:
    """Uniform e4m3 bit patterns (every exponent, subnormals and both zeros included), NaN only if asked."""
    w = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    if not nan:
        w[(w == 0x7F) | (w == 0xFF)] = 0x7E
    return w.view(torch.float8_e4m3fn)


def _scales(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Positive scales over several binades, like amax / 448 of real blocks (1e-5 .. 1e-1)."""
    return torch.exp(torch.empty(-(-n // 128), -(-k // 128)).uniform_(-11.5, -2.3, generator=g))


def _case(seed: int, m: int, n: int, k: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    return x, _bytes(g, n, k), _scales(g, n, k), torch.randn(n, generator=g) if bias else None


def _agrees(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> bool:
    """got equals x @ dequant(w, s)^T + b up to fp32 summation order (NaN where the reference is NaN)."""
    deq = dequantize_fp8_ref(w, s).double()
    want = x.double() @ deq.T + (0 if b is None else b.double())
    eps = torch.finfo(torch.float32).eps
    bound = 4 * x.shape[-1] * eps * (x.abs().double() @ deq.abs().T) + (0 if b is None else b.abs().double() * eps)
    nan, inf = want.isnan(), want.isinf()
    if not torch.equal(got.isnan(), nan) or not torch.equal(got[inf].double(), want[inf]):
        return False
    finite = want.isfinite()
    return bool(((got.double() - want).abs() <= bound + 1e-30)[finite].all())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), m=st.integers(1, 33), n=st.integers(1, 300), k=st.integers(1, 300),
       bias=st.booleans(), nan=st.sampled_from([False, False, True]))  # fmt: skip
def test_matches_the_reference(isa: str, seed: int, m: int, n: int, k: int, bias: bool, nan: bool) -> None:
    """nan: NaN bytes too (1 in 128), so some output columns are NaN, others not."""
    x, w, s, b = _case(seed, m, n, k, bias)
    if nan:
        w = _bytes(torch.Generator().manual_seed(seed), n, k, nan=True)
    got = torch.ops.mtp.linear_fp8(x, w, s, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert _agrees(got, x, w, s, b)
    want = linear_fp8_ref(x, w, s, b)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.nan_to_num().abs().max()) + 1e-30, equal_nan=True)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", [(256, 2), (5, 130), (130, 260), (3, 19)])
def test_every_byte_value_is_exact(isa: str, n: int, k: int) -> None:
    """One-hot activations pick single weights: no summation, so y == dequant(w) bit for bit, for all 254 finite
    bytes (subnormals m * 2^-9, -0, +-448) in every position of the vector loops (full chunks, tails, the partial
    128-blocks) on both the few-row (<= 15 rows) and the tiled (16+ rows) paths."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.arange(n * k, dtype=torch.int64) % 254).to(torch.uint8).view(n, k)  # 0x00..0xfd: no NaN bytes
    w = w[:, torch.randperm(k, generator=g)].contiguous()
    w[w == 0x7F] = 0xFE
    s = _scales(g, n, k)
    deq = dequantize_fp8_ref(w, s)
    for rows in (torch.arange(min(k, 15)), torch.arange(k)):
        x = torch.zeros(len(rows), k)
        x[torch.arange(len(rows)), rows] = 1.0
        got = torch.ops.mtp.linear_fp8(x, w.view(torch.float8_e4m3fn), s, None)
        assert torch.equal(got + 0.0, deq.T[rows] + 0.0)  # + 0.0: -0 weights sum to +0


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 4, 20])
def test_nan_bytes_give_nan(isa: str, m: int) -> None:
    """0x7f / 0xff are e4m3fn's NaNs (it has no infinities): every output using such a weight is NaN, the others are
    untouched."""
    x, w, s, b = _case(7, m, 140, 300, True)
    w = w.view(torch.uint8).clone()
    w[3, 17], w[139, 299], w[64, 128] = 0x7F, 0xFF, 0x7F
    got = torch.ops.mtp.linear_fp8(x, w.view(torch.float8_e4m3fn), s, b)
    assert got.isnan().sum() == 3 * m and got[:, [3, 64, 139]].isnan().all()
    assert _agrees(got, x, w, s, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("block", [(0, 0), (1, 1), (0, 2), (2, 0), (2, 2)])
def test_a_planted_wrong_scale_is_caught(isa: str, m: int, block: tuple[int, int]) -> None:
    """The agreement check is tight enough to see one scale block 25% off, edge blocks (44 rows / columns) included:
    a kernel that read a neighbouring block's scale, or applied a block's scale to the wrong columns, fails it."""
    x, w, s, b = _case(11, m, 300, 300, True)
    assert _agrees(torch.ops.mtp.linear_fp8(x, w, s, b), x, w, s, b)
    planted = s.clone()
    planted[block] *= 1.25
    assert not _agrees(torch.ops.mtp.linear_fp8(x, w, planted, b), x, w, s, b)
    assert _agrees(torch.ops.mtp.linear_fp8(x, w, planted, b), x, w, planted, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 5, 20])
def test_extreme_scales(isa: str, m: int) -> None:
    """An infinite scale gives what the reference gives (0 * inf = NaN, else +-inf, then sums); a finite scale beyond
    the vector conversion's exact range (|s| >= 2^120) takes the portable path, still exact (activations scaled down
    so that only single weights overflow, as they do in the reference, not fp32 partial sums); a zero or subnormal
    scale too. Planted in a full block and in the partial corner block."""
    x, w, s, _ = _case(13, m, 200, 260, False)
    for block in ((0, 0), (1, 2)):
        for special, x_scale in ((float("inf"), 1.0), (2.0**121, 2.0**-100), (-(2.0**125), 2.0**-100), (0.0, 1.0),
                                 (2.0**-140, 1.0)):  # fmt: skip
            planted = s.clone()
            planted[block] = special
            xs = x * x_scale
            assert _agrees(torch.ops.mtp.linear_fp8(xs, w, planted, None), xs, w, planted, None), (block, special)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_row_does_not_depend_on_the_batch(isa: str) -> None:
    """Below the tiled path every row runs the same operations whatever the row count: decode == verify rows."""
    x, w, s, b = _case(1, 15, 137, 333, True)
    full = torch.ops.mtp.linear_fp8(x, w, s, b)
    for m in (1, 2, 3, 4, 5, 8):
        assert torch.equal(torch.ops.mtp.linear_fp8(x[:m], w, s, b), full[:m])


@pytest.mark.parametrize("m", [1, 3, 20])
def test_threads_do_not_change_the_result(m: int) -> None:
    """at::parallel_for splits output features (few rows) or tile rows (many): each value is computed by the same
    operations whatever thread runs it."""
    x, w, s, b = _case(5, m, 1000, 384, True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.mtp.linear_fp8(x, w, s, b)
        torch.set_num_threads(2)
        two = torch.ops.mtp.linear_fp8(x, w, s, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_uint8_bits_leading_dims_and_strided_activations() -> None:
    x, w, s, b = _case(2, 12, 9, 140, True)
    want = torch.ops.mtp.linear_fp8(x, w, s, b)
    assert torch.equal(torch.ops.mtp.linear_fp8(x, w.view(torch.uint8), s, b), want)
    got = torch.ops.mtp.linear_fp8(x.view(3, 4, 140), w, s, b)
    assert got.shape == (3, 4, 9) and torch.equal(got.view(12, 9), want)
    wide = torch.randn(12, 280)
    wide[:, ::2] = x
    assert torch.equal(torch.ops.mtp.linear_fp8(wide[:, ::2], w, s, b), want)
    assert torch.equal(torch.ops.mtp.linear_fp8(x, w, s.t().contiguous().t(), b), want)  # a strided scale
    assert torch.ops.mtp.linear_fp8(x[:0], w, s, b).shape == (0, 9)
    empty_k = torch.ops.mtp.linear_fp8(torch.ones(2, 0), w[:, :0], s[:, :0], b)
    assert torch.equal(empty_k, b.expand(2, 9))


def test_the_cpu_kernel_is_the_cpp_library() -> None:
    dump = torch._C._dispatch_dump("mtp::linear_fp8")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/linear_fp8.cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump


def test_fake() -> None:
    """The shape rule torch.export traces with (meta tensors run the fake)."""
    x = torch.empty(2, 3, 130, device="meta")
    w = torch.empty(5, 130, dtype=torch.float8_e4m3fn, device="meta")
    y = torch.ops.mtp.linear_fp8(x, w, torch.empty(1, 2, device="meta"), None)
    assert y.shape == (2, 3, 5) and y.dtype == torch.float32


@pytest.mark.parametrize("args,match", [
    (lambda x, w, s, b: (x.double(), w, s, b), "x must be fp32"),
    (lambda x, w, s, b: (x, w.float(), s, b), "weight must be a 2-D float8_e4m3fn tensor"),
    (lambda x, w, s, b: (x, w.view(torch.uint8).view(torch.int8), s, b), "weight must be a 2-D float8_e4m3fn"),
    (lambda x, w, s, b: (x, w.float().to(torch.float8_e5m2), s, b), "weight must be a 2-D float8_e4m3fn"),
    (lambda x, w, s, b: (x, w[None], s, b), "weight must be a 2-D float8_e4m3fn"),
    (lambda x, w, s, b: (x, torch.zeros(136, 200, dtype=torch.float8_e4m3fn).t(), s, b), "weight must be contiguous"),
    (lambda x, w, s, b: (x, w, s[:1], b), r"scale_inv must be fp32 \[2, 2\]"),
    (lambda x, w, s, b: (x, w, s.double(), b), r"scale_inv must be fp32 \[2, 2\]"),
    (lambda x, w, s, b: (x, w, s[0], b), r"scale_inv must be fp32 \[2, 2\]"),
    (lambda x, w, s, b: (x[:, :5], w, s, b), r"x must be \[\.\.\., 136\]"),
    (lambda x, w, s, b: (x, w, s, b[:3]), r"bias must be an fp32 CPU tensor \[200\]"),
    (lambda x, w, s, b: (x, w, s, b.bfloat16()), "bias must be an fp32"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, match) -> None:
    x, w, s, b = _case(3, 4, 200, 136, True)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.linear_fp8(*args(x, w, s, b))
    assert len(str(e.value).strip().splitlines()) == 1
