"""mtp::linear_bf16 (plugins/csrc/linear_bf16.cpp): fp32 activations times a bf16 weight read as bf16, fp32 math.

Against the fp64 reference x @ w.float().T + b, so only the fp32 summation order separates them, on every
instruction set this CPU has (portable, AVX2, AVX-512), for the few-row path (decode / verify / draft) and the
converted-tile MKL path (prefill chunks), and on a CPU with AMX-BF16 the exact AMX path (plugins/csrc/amx_bf16.cpp)
forced on for every row count; no path rounds an activation to bf16; a row's result does not depend on the rest of
the batch on the few-row and AMX paths; bad input is a one-line ValueError."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.cpp_ops as cpp_ops
import plugins.ops  # noqa: F401  (the fake, from the spec)
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512

ISAS = ["generic"] + (["avx2"] if HAS_AVX2 else []) + (["avx512"] if HAS_AVX512 else [])
HAS_AMX = cpp_ops.amx_min_rows() > 0
# (ISA, AMX from this many rows): AVX-512 without AMX (its register tiles and MKL paths), then AMX for every row
PATHS = [(i, 1 << 30) for i in ISAS] + ([("avx512", 1)] if HAS_AMX else [])


@pytest.fixture(params=PATHS, ids=[f"{i}-amx" if r == 1 else i for i, r in PATHS])
def path(request):
    isa, rows = request.param
    before, before_rows = cpp_ops.cpu_isa(), cpp_ops.amx_min_rows()
    cpp_ops.cpu_isa(isa)
    if HAS_AMX:
        cpp_ops.amx_min_rows(rows)
    yield request.param
    cpp_ops.cpu_isa(before)
    if HAS_AMX:
        cpp_ops.amx_min_rows(before_rows)


SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


def _case(seed: int, m: int, n: int, k: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    return x, w, torch.randn(n, generator=g) if bias else None


@SETTINGS
@given(seed=st.integers(0, 2**16), m=st.integers(1, 70), n=st.integers(1, 41), k=st.integers(1, 300),
       bias=st.booleans())  # fmt: skip
def test_matches_the_upcast_linear(path, seed: int, m: int, n: int, k: int, bias: bool) -> None:
    x, w, b = _case(seed, m, n, k, bias)
    got = torch.ops.mtp.linear_bf16(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = _reference(x, w, b)
    # fp32 rounding of a k-term sum: a few ulps of the magnitude of the terms, never more
    scale = (x.abs().double() @ w.double().abs().T).float() + (0 if b is None else b.abs())
    assert ((got - want).abs() <= 4 * k * torch.finfo(torch.float32).eps * scale + 1e-30).all()


@pytest.mark.parametrize("m", [1, 15, 16, 40])
def test_no_path_rounds_an_activation_to_bf16(path, m: int) -> None:
    """x @ [1, 0, ...]^T is x[:, 0] exactly when each product is exact: an activation rounded to bf16 (vdpbf16ps or
    AMX on bf16 activations, or two of AMX's three parts) would lose its low mantissa bits. 16 and 40 rows take the
    many-row path; AMX forced on takes all of them (and 40 rows, three activation tiles)."""
    x = torch.randn(m, 70, generator=torch.Generator().manual_seed(m)) * 3.0
    w = torch.zeros(33, 70, dtype=torch.bfloat16)
    w[:, 0] = 1.0
    y = torch.ops.mtp.linear_bf16(x, w, None)
    assert torch.equal(y, x[:, :1].expand(m, 33))
    assert not torch.equal(x[:, 0].bfloat16().float(), x[:, 0])  # the test can fail: bf16 would change these


def test_a_row_does_not_depend_on_the_batch(path) -> None:
    """Below the tiled path, and on AMX at any row count, every row runs the same operations whatever the row count:
    decode == verify rows."""
    x, w, b = _case(1, 15, 37, 133, True)
    full = torch.ops.mtp.linear_bf16(x, w, b)
    for m in (1, 2, 3, 4, 5, 8):
        assert torch.equal(torch.ops.mtp.linear_bf16(x[:m], w, b), full[:m])


def test_leading_dims_and_strided_activations() -> None:
    x, w, b = _case(2, 12, 9, 40, True)
    got = torch.ops.mtp.linear_bf16(x.view(3, 4, 40), w, b)
    assert got.shape == (3, 4, 9) and torch.equal(got.view(12, 9), torch.ops.mtp.linear_bf16(x, w, b))
    wide = torch.randn(12, 80)
    wide[:, ::2] = x
    assert torch.equal(torch.ops.mtp.linear_bf16(wide[:, ::2], w, b), torch.ops.mtp.linear_bf16(x, w, b))
    assert torch.ops.mtp.linear_bf16(x[:0], w, b).shape == (0, 9)


def test_fake_follows_the_spec() -> None:
    """The shape rule torch.export traces with (meta tensors run the spec's fake)."""
    x, w = torch.empty(2, 3, 16, device="meta"), torch.empty(5, 16, dtype=torch.bfloat16, device="meta")
    y = torch.ops.mtp.linear_bf16(x, w, None)
    assert y.shape == (2, 3, 5) and y.dtype == torch.float32


@pytest.mark.parametrize("args,match", [
    (lambda x, w, b: (x.double(), w, b), "x must be fp32"),
    (lambda x, w, b: (x, w.float(), b), "weight must be a 2-D bf16 tensor"),
    (lambda x, w, b: (x, torch.randn(16, 8).bfloat16().t(), b), "weight must be contiguous"),
    (lambda x, w, b: (x[:, :5], w, b), r"x must be \[\.\.\., 8\]"),
    (lambda x, w, b: (x, w, b[:3]), r"bias must be an fp32 CPU tensor \[16\]"),
    (lambda x, w, b: (x, w, b.bfloat16()), "bias must be an fp32"),
])  # fmt: skip
def test_bad_input_is_one_line_value_error(args, match) -> None:
    x, w, b = _case(3, 4, 16, 8, True)
    with pytest.raises(ValueError, match=match) as e:
        torch.ops.mtp.linear_bf16(*args(x, w, b))
    assert len(str(e.value).strip().splitlines()) == 1
