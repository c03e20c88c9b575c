"""`mtp::swa_paged_attention` (the paged attention op's sliding-window mode with sinks): the C++ kernel is what the
dispatcher runs and matches plugins/reference_swa.py under every instruction set, at real head widths, windows
smaller and larger than the context and chunks of more than 64 query rows; bad input gets a one-line ValueError.
The reference itself is checked against transformers' eager attention with sinks (the definition it claims)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton / plugins.triton_kernels

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import plugins.swa_ops  # noqa: F401
from plugins.kv_pool import KVPoolGeometry, pool_address
from plugins.reference_swa import swa_paged_attention_ref
from tests.plugins.cases import Case, filled_pool, tolerance
from tests.plugins.test_cpp_ops import ISAS, SETTINGS, WIDE_NO_HOLES

FEW = settings(SETTINGS, max_examples=12)  # per ISA; the geometries are test_cpp_ops.py's, already swept there

AFTER = torch.zeros(1, dtype=torch.int64)


def run(pool, geom: KVPoolGeometry, q, counts, kv_lens, tables, plane: int, window: int, sinks) -> torch.Tensor:
    return torch.ops.mtp.swa_paged_attention(q, counts, kv_lens, tables, pool_address(pool), AFTER, sinks, plane,
                                             *geom.attrs().values(), geom.head_dim**-0.5, window)  # fmt: skip


def test_the_cpu_kernel_is_the_cpp_library() -> None:
    dump = torch._C._dispatch_dump("mtp::swa_paged_attention")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "swa_paged_attention.cpp" in cpu[0], dump


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@FEW
@given(c=WIDE_NO_HOLES, window=st.sampled_from([0, 1, 3, 8]), seed=st.integers(0, 2**16))
def test_matches_the_reference_at_model_width(isa: str, c: Case, window: int, seed: int) -> None:
    pool = filled_pool(c.geom, seed=3)
    sinks = 2 * torch.randn(c.q.shape[1], generator=torch.Generator().manual_seed(seed))
    expected = swa_paged_attention_ref(pool, c.q, c.counts, c.kv_lens, c.tables, c.plane, c.geom.head_dim**-0.5,
                                       window, sinks)  # fmt: skip
    out = run(pool, c.geom, c.q, c.counts, c.kv_lens, c.tables, c.plane, window, sinks)
    assert out.dtype == c.q.dtype and out.shape == c.q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(c.q.dtype), rtol=0)
    assert torch.all(out[int(c.counts.sum()) :] == 0)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("window", [0, 5, 37])
def test_long_prefill_and_decode_cross_the_window(isa: str, window: int) -> None:
    """A 150-row prefill (several 64-row chunks, the window ending mid-chunk) packed with a 1-row decode."""
    geom = KVPoolGeometry(1, 64, 8, 2, 64, 0)
    pool = filled_pool(geom, seed=5)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(151, 4, 64, generator=g)
    counts, kv_lens = torch.tensor([150, 1], dtype=torch.int32), torch.tensor([150, 90], dtype=torch.int32)
    tables = torch.stack([torch.arange(1, 25), torch.arange(30, 54)]).to(torch.int32)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    expected = swa_paged_attention_ref(pool, q, counts, kv_lens, tables, 0, 64**-0.5, window, sinks)
    torch.testing.assert_close(run(pool, geom, q, counts, kv_lens, tables, 0, window, sinks), expected, atol=2e-5,
                               rtol=0)  # fmt: skip


def test_reference_is_transformers_eager_attention_with_sinks() -> None:
    """One request in one contiguous block run: the reference equals transformers' MiMo-V2-Flash eager attention
    (sinks as `module.sinks`, the sliding-window mask as transformers builds it: key i - window < j <= i)."""
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import eager_attention_forward

    n, window, geom = 20, 6, KVPoolGeometry(1, 8, 4, 2, 16, 0)
    pool = filled_pool(geom, seed=2)
    q = torch.randn(n, 4, 16, generator=torch.Generator().manual_seed(0))
    sinks = torch.tensor([1.0, -0.5, 0.2, 2.0])
    tables = torch.arange(1, 6, dtype=torch.int32)[None]
    expected = swa_paged_attention_ref(pool, q, torch.tensor([n]), torch.tensor([n]), tables, 0, 0.25, window, sinks)
    keys, values = pool[0, 0, 1:6].reshape(-1, 2, 16)[:n], pool[0, 1, 1:6].reshape(-1, 2, 16)[:n]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = torch.where((j <= i) & (j > i - window), 0.0, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    got, _ = eager_attention_forward(module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                     values.transpose(0, 1)[None], mask, scaling=0.25)  # fmt: skip
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=0)


def test_bad_sinks_and_window_are_one_line_errors() -> None:
    geom = KVPoolGeometry(1, 4, 4, 1, 8, 0)
    pool = filled_pool(geom, seed=1)
    q, one = torch.randn(2, 2, 8), torch.tensor([2], dtype=torch.int32)
    tables = torch.tensor([[1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sinks must be float32 \[Hq=2\]"):
        run(pool, geom, q, one, one, tables, 0, 0, torch.zeros(3))
    with pytest.raises(ValueError, match="window must be >= 0"):
        run(pool, geom, q, one, one, tables, 0, -1, torch.zeros(2))


@pytest.mark.parametrize("kernel", ["triton"])  # the CPU interpreter (TRITON_INTERPRET=1, set above)
@pytest.mark.parametrize("window, with_sinks", [(0, True), (3, False), (3, True)])
def test_triton_kernel_matches_the_reference(kernel: str, window: int, with_sinks: bool) -> None:
    """The CUDA implementation (the Triton paged attention kernel's window + sinks mode): a 7-row prefill packed with
    a padded request and a 1-row decode, GQA group 2, block-crossing windows."""
    triton_kernels = pytest.importorskip("plugins.triton_kernels")
    geom = KVPoolGeometry(2, 12, 2, 2, 8, 0)
    pool = filled_pool(geom, seed=4)
    q = torch.randn(9, 4, 8, generator=torch.Generator().manual_seed(2))  # 8 live rows + 1 padding row
    counts, kv_lens = torch.tensor([7, 0, 1], dtype=torch.int32), torch.tensor([7, 0, 6], dtype=torch.int32)
    tables = torch.tensor([[3, 1, 5, 7], [-1, -1, -1, -1], [2, 4, 6, -1]], dtype=torch.int32)
    sinks = torch.tensor([1.0, -0.5, 0.2, 2.0]) if with_sinks else None
    expected = swa_paged_attention_ref(pool, q, counts, kv_lens, tables, 1, 0.3, window,
                                       torch.full((4,), -1e9) if sinks is None else sinks)  # fmt: skip
    out = triton_kernels.paged_attention_triton(q, counts, kv_lens, tables, pool.data_ptr(), 1, geom, 0.3,
                                                window=window, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
