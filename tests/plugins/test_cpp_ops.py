"""The C++ CPU kernels (plugins/csrc/): they are what the dispatcher runs, they match plugins/reference.py at the
model's real widths under both instruction sets (AVX-512 and the portable path), a row's result does not depend
on the rest of the batch, they run under torch.compile(fullgraph=True) exactly as in eager, and bad input gets
a one-line ValueError. (tests/plugins/test_kv_attention.py, test_mla.py and test_moe.py run the same ops on the
small hypothesis geometries: padded rows, -1 holes, count-0 segments, the poisoned pool, fp32/fp16/bf16.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins.cpp_ops as cpp_ops
import plugins.gdn_ops  # noqa: F401
import plugins.mla_ops  # noqa: F401
import plugins.ops  # noqa: F401
from plugins.kv_pool import DTYPE_CODES, KVPoolGeometry, allocate_pool, pool_address
from plugins.reference import (
    kv_write_ref,
    mla_kv_write_ref,
    mla_paged_attention_ref,
    moe_experts_ref,
    paged_attention_ref,
)
from tests.plugins.cases import Case, cases, filled_pool, tolerance
from tests.plugins.conftest import HAS_AVX2, HAS_AVX512

# The `isa` fixture holds for all examples of a test on purpose (it picks the kernels' instruction set).
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
OPS = ["kv_write", "paged_attention", "moe_experts", "moe_experts_local", "mla_kv_write", "mla_paged_attention",
       "linear_bf16", "gdn_step"]
# "best" is avx512 where the CPU has it, else avx2; an AVX-512 machine runs the AVX2 path too
ISAS = ["generic", "best"] + (["avx2"] if HAS_AVX512 and HAS_AVX2 else [])


@pytest.mark.parametrize("op", OPS)
def test_the_cpu_kernel_is_the_cpp_library(op: str) -> None:
    """The dispatcher's CPU kernel of every op was registered from plugins/csrc/ (not a Python kernel), and the
    schema comes from the one C++ registration file."""
    dump = torch._C._dispatch_dump(f"mtp::{op}")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "plugins/csrc/" in cpu[0] and ".cpp" in cpu[0], dump
    assert "registration.cpp" in dump.split("debug:")[1].splitlines()[0], dump
    assert "Python" not in cpu[0]


def test_isa_follows_the_cpu() -> None:
    assert cpp_ops.cpu_isa() == ("avx512" if HAS_AVX512 else "avx2" if HAS_AVX2 else "generic")
    with pytest.raises(ValueError, match="unknown isa"):
        cpp_ops.cpu_isa("sse9")


def _widen(c: Case, head_dim: int, gen: torch.Generator) -> Case:
    """The same segments and tables at a real head width (the AVX-512 loops' full chunks and tails)."""
    geom = dataclasses.replace(c.geom, head_dim=head_dim)
    rows, dtype = c.k.shape[0], c.k.dtype
    k, v = (torch.randn(rows, geom.num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(rows, geom.num_kv_heads * c.group, head_dim, generator=gen).to(dtype)
    rope = min(c.rope_dim * head_dim // c.geom.head_dim, head_dim) // 2 * 2
    return dataclasses.replace(c, geom=geom, k=k, v=v, q=q, rope_dim=rope)


WIDE = st.builds(_widen, cases(), st.sampled_from([32, 40, 64]),
                 st.integers(0, 2**16).map(lambda s: torch.Generator().manual_seed(s)))  # fmt: skip
WIDE_NO_HOLES = st.builds(_widen, cases(holes=False), st.sampled_from([32, 40, 64]),
                          st.integers(0, 2**16).map(lambda s: torch.Generator().manual_seed(s)))  # fmt: skip


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(c=WIDE)
def test_kv_write_at_model_width(isa: str, c: Case) -> None:
    """Poisoned pool: every slot the reference does not write stays NaN, bit for bit; written slots match."""
    pool = torch.full(c.geom.shape, float("nan"), dtype=c.geom.dtype)
    expected = pool.clone()
    n_ref = kv_write_ref(expected, c.k, c.v, c.counts, c.starts, c.tables, c.plane, c.rope_dim, 10000.0)
    out = torch.ops.mtp.kv_write(c.k, c.v, c.counts, c.starts, c.tables, pool_address(pool), c.plane,
                                 *c.geom.attrs().values(), c.rope_dim, 10000.0)  # fmt: skip
    assert int(out[0]) == n_ref
    assert torch.equal(pool.isnan(), expected.isnan())
    torch.testing.assert_close(pool.float().nan_to_num(), expected.float().nan_to_num(), atol=tolerance(c.geom.dtype),
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(c=WIDE_NO_HOLES)
def test_paged_attention_at_model_width(isa: str, c: Case) -> None:
    pool = filled_pool(c.geom, seed=3)
    scale = c.geom.head_dim**-0.5
    expected = paged_attention_ref(pool, c.q, c.counts, c.kv_lens, c.tables, c.plane, scale)
    out = torch.ops.mtp.paged_attention(c.q, c.counts, c.kv_lens, c.tables, pool_address(pool),
                                        torch.zeros(1, dtype=torch.int64), c.plane, *c.geom.attrs().values(), scale)  # fmt: skip
    assert out.dtype == c.q.dtype and out.shape == c.q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(c.q.dtype), rtol=0)
    assert torch.all(out[int(c.counts.sum()) :] == 0)


@st.composite
def mla_wide(draw, holes: bool):
    c = draw(cases(dtypes=(torch.float32, torch.bfloat16), holes=holes))
    rope_dim = draw(st.sampled_from([0, 8, 64]))
    latent_dim = rope_dim + draw(st.sampled_from([24, 64]))
    heads = draw(st.integers(1, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    geom = KVPoolGeometry(c.geom.num_planes, c.geom.num_blocks, c.geom.block_size, 1, latent_dim, c.geom.dtype_code,
                          kv_kind=1)  # fmt: skip
    rows = c.k.shape[0]
    inv_freq = torch.rand(rope_dim // 2, generator=gen) * 1.5 + 0.05
    scale = draw(st.sampled_from([1.0, 0.8, 1.37]))  # YaRN's attention factor multiplies cos and sin
    return (geom, c, torch.randn(rows, latent_dim, generator=gen).to(c.k.dtype),
            torch.randn(rows, heads, latent_dim, generator=gen).to(c.k.dtype), rope_dim, inv_freq, scale)  # fmt: skip


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(m=mla_wide(holes=True))
def test_mla_kv_write_at_model_width(isa: str, m) -> None:
    geom, c, latent, _, rope_dim, inv_freq, rope_scale = m
    pool = torch.full(geom.shape, float("nan"), dtype=geom.dtype)
    expected = pool.clone()
    n_ref = mla_kv_write_ref(expected, latent, c.counts, c.starts, c.tables, c.plane, inv_freq, rope_dim, rope_scale)
    out = torch.ops.mtp.mla_kv_write(latent, c.counts, c.starts, c.tables, pool_address(pool), inv_freq, c.plane,
                                     *geom.attrs().values(), rope_dim, rope_scale)  # fmt: skip
    assert int(out[0]) == n_ref
    assert torch.equal(pool.isnan(), expected.isnan())
    torch.testing.assert_close(pool.float().nan_to_num(), expected.float().nan_to_num(), atol=tolerance(geom.dtype),
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(m=mla_wide(holes=False))
def test_mla_paged_attention_at_model_width(isa: str, m) -> None:
    geom, c, _, q, rope_dim, _, _ = m
    pool = filled_pool(geom, seed=4)
    scale = geom.head_dim**-0.5
    expected = mla_paged_attention_ref(pool, q, c.counts, c.kv_lens, c.tables, c.plane, rope_dim, scale)
    out = torch.ops.mtp.mla_paged_attention(q, c.counts, c.kv_lens, c.tables, pool_address(pool),
                                            torch.zeros(1, dtype=torch.int64), c.plane, *geom.attrs().values(),
                                            rope_dim, scale)  # fmt: skip
    assert out.shape == (q.shape[0], q.shape[1], geom.head_dim - rope_dim)
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(q.dtype), rtol=0)
    assert torch.all(out[int(c.counts.sum()) :] == 0)


def _moe_inputs(seed: int, tokens: int, hidden: int, inter: int, num_local: int, top_k: int, act: torch.dtype,
                weights: torch.dtype, id_dtype: torch.dtype, span: int):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(act)
    ids = torch.randint(0, span, (tokens, top_k), generator=gen).to(id_dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(act)
    w_gate_up = (torch.randn(num_local, 2 * inter, hidden, generator=gen) / hidden**0.5).to(weights)
    w_down = (torch.randn(num_local, hidden, inter, generator=gen) / inter**0.5).to(weights)
    return x, ids, w, w_gate_up, w_down


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@SETTINGS
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 9), hidden=st.sampled_from([16, 40, 256]),
       inter=st.sampled_from([8, 24, 96]), num_local=st.sampled_from([1, 4, 8]), top_k=st.integers(1, 3),
       act=st.sampled_from([torch.float32, torch.bfloat16]), weights=st.sampled_from([torch.float32, torch.bfloat16]),
       id_dtype=st.sampled_from([torch.int64, torch.int32]), offset=st.sampled_from([0, 2]))  # fmt: skip
def test_moe_experts_local_matches_reference(isa: str, seed, tokens, hidden, inter, num_local, top_k, act, weights,
                                             id_dtype, offset) -> None:  # fmt: skip
    """bf16 or fp32 weights read in place; offset 2: ids outside [2, 2 + E_local) are other ranks' (contribute 0)."""
    x, ids, w, w_gate_up, w_down = _moe_inputs(seed, tokens, hidden, inter, num_local, top_k, act, weights, id_dtype,
                                               num_local + 2 * bool(offset))  # fmt: skip
    out = torch.ops.mtp.moe_experts_local(x, ids, w, w_gate_up, w_down, offset)
    ref = moe_experts_ref(x, ids.long(), w, w_gate_up, w_down, offset)
    assert out.dtype == act and out.shape == x.shape
    atol, rtol = (1e-5, 1e-4) if act == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    if offset == 0:
        torch.testing.assert_close(torch.ops.mtp.moe_experts(x, ids, w, w_gate_up, w_down, num_local, 1), out,
                                   atol=0, rtol=0)  # fmt: skip


def test_a_row_does_not_depend_on_the_batch() -> None:
    """The same request (attention) or token (MoE) alone and inside a batch gives bit-identical output: the
    verify step (K+1 rows) and the K=0 step (1 row) compute a shared row the same way."""
    geom = KVPoolGeometry(1, 16, 4, 2, 32)
    pool = filled_pool(geom, seed=5)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 8, 32, generator=gen)
    tables = torch.arange(1, 13, dtype=torch.int32).view(3, 4)
    after = torch.zeros(1, dtype=torch.int64)

    def attend(qs, counts, lens, tabs):
        return torch.ops.mtp.paged_attention(qs, torch.tensor(counts, dtype=torch.int32),
                                             torch.tensor(lens, dtype=torch.int32), tabs, pool_address(pool), after, 0,
                                             *geom.attrs().values(), 32**-0.5)  # fmt: skip

    batch = attend(q, [1, 4, 1], [9, 13, 5], tables)
    assert torch.equal(attend(q[1:5], [4], [13], tables[1:2]), batch[1:5])
    assert torch.equal(attend(q[4:5], [1], [13], tables[1:2]), batch[4:5])  # the last verify row == a K=0 row
    x, ids, w, w_gate_up, w_down = _moe_inputs(1, 7, 256, 96, 8, 2, torch.float32, torch.bfloat16, torch.int64, 8)
    full = torch.ops.mtp.moe_experts(x, ids, w, w_gate_up, w_down, 8, 1)
    for t in range(7):
        assert torch.equal(torch.ops.mtp.moe_experts(x[t : t + 1], ids[t : t + 1], w[t : t + 1], w_gate_up, w_down,
                                                     8, 1), full[t : t + 1])  # fmt: skip


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefill_attention_matches_reference(isa: str, dtype: torch.dtype) -> None:
    """More query rows than one chunk of the kernel (64 rows of queries x group): GQA 70 queries x 4 heads per
    KV head after 5 cached positions, MLA 9 queries x 20 heads; and the last row equals itself computed alone."""
    gen = torch.Generator().manual_seed(2)
    tables = torch.tensor([[3, 1, 4, 6, 2]], dtype=torch.int32)
    counts, lens = torch.tensor([70], dtype=torch.int32), torch.tensor([75], dtype=torch.int32)
    after = torch.zeros(1, dtype=torch.int64)
    geom = KVPoolGeometry(1, 7, 16, 2, 32, DTYPE_CODES[dtype])
    pool = filled_pool(geom, seed=6)
    q = torch.randn(72, 8, 32, generator=gen).to(dtype)
    out = torch.ops.mtp.paged_attention(q, counts, lens, tables, pool_address(pool), after, 0, *geom.attrs().values(),
                                        0.2)  # fmt: skip
    expected = paged_attention_ref(pool, q, counts, lens, tables, 0, 0.2)
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(dtype), rtol=0)
    alone = torch.ops.mtp.paged_attention(q[69:70], torch.tensor([1], dtype=torch.int32), lens, tables,
                                          pool_address(pool), after, 0, *geom.attrs().values(), 0.2)  # fmt: skip
    assert torch.equal(alone, out[69:70])
    mgeom = KVPoolGeometry(1, 7, 16, 1, 72, DTYPE_CODES[dtype], kv_kind=1)
    mpool = filled_pool(mgeom, seed=7)
    mq = torch.randn(9, 20, 72, generator=gen).to(dtype)
    mcounts, mlens = torch.tensor([9], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    mout = torch.ops.mtp.mla_paged_attention(mq, mcounts, mlens, tables, pool_address(mpool), after, 0,
                                             *mgeom.attrs().values(), 8, 0.1)  # fmt: skip
    mexpected = mla_paged_attention_ref(mpool, mq, mcounts, mlens, tables, 0, 8, 0.1)
    torch.testing.assert_close(mout.float(), mexpected.float(), atol=tolerance(dtype), rtol=0)


class _Layer(torch.nn.Module):
    """One decoder layer's plugin calls: roped K/V write, paged attention ordered after it, routed experts."""

    def __init__(self, geom: KVPoolGeometry) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.geom = geom
        self.w_gate_up = torch.nn.Parameter((torch.randn(8, 192, 256, generator=gen) / 16).bfloat16(), False)
        self.w_down = torch.nn.Parameter((torch.randn(8, 256, 96, generator=gen) / 10).bfloat16(), False)

    def forward(self, k, v, q, x, ids, w, counts, starts, kv_lens, tables, pool_ptr):
        g = self.geom.attrs().values()
        n = torch.ops.mtp.kv_write(k, v, counts, starts, tables, pool_ptr, 1, *g, 16, 10000.0)
        att = torch.ops.mtp.paged_attention(q, counts, kv_lens, tables, pool_ptr, n, 1, *g, 32**-0.5)
        moe = torch.ops.mtp.moe_experts(x, ids, w, self.w_gate_up, self.w_down, 8, 1)
        return att * 2.0, moe + 1.0, n


def _layer_inputs():
    geom = KVPoolGeometry(2, 9, 16, 2, 32)
    gen = torch.Generator().manual_seed(1)
    counts, starts = torch.tensor([2, 0, 3], dtype=torch.int32), torch.tensor([17, 0, 30], dtype=torch.int32)
    tables = torch.tensor([[1, 2, -1], [-1, -1, -1], [3, 4, 5]], dtype=torch.int32)
    k, v = torch.randn(6, 2, 32, generator=gen), torch.randn(6, 2, 32, generator=gen)
    q, x = torch.randn(6, 8, 32, generator=gen), torch.randn(6, 256, generator=gen)
    ids, w = torch.randint(0, 8, (6, 2), generator=gen), torch.rand(6, 2, generator=gen)
    return geom, (k, v, q, x, ids, w, counts, starts, starts + counts, tables)


def _same_as_eager(run) -> None:
    """run(layer, args + (pool_ptr,)) gives the eager outputs and leaves the same pool."""
    geom, args = _layer_inputs()
    layer = _Layer(geom)
    outs = []
    for fn in (layer, run(layer, args)):
        pool = filled_pool(geom, seed=2)
        with torch.inference_mode():
            outs.append((*fn(*args, pool_address(pool)), pool))
    for eager, other in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(other, eager, atol=1e-6, rtol=1e-6)
    assert int(outs[1][2][0]) == 5


def test_ops_run_under_torch_compile_fullgraph_like_eager() -> None:
    _same_as_eager(lambda layer, args: torch.compile(layer, fullgraph=True))


@pytest.mark.slow
def test_ops_run_in_an_aotinductor_package_like_eager(tmp_path) -> None:
    """The package calls the ops through AOTInductor's C++ proxy executor (the dispatcher, no Python)."""

    def package(layer, args):
        geom_ptr = pool_address(allocate_pool(layer.geom))
        program = torch.export.export(layer, (*args, geom_ptr))
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "layer.pt2"))
        return torch._inductor.aoti_load_package(path)

    _same_as_eager(package)


def test_metadata_rewritten_in_place_is_read_afresh() -> None:
    """Captured execution rewrites its metadata buffers between steps: the second write lands in the new block."""
    geom = KVPoolGeometry(1, 4, 2, 1, 4)
    pool = allocate_pool(geom)
    k = torch.randn(1, 1, 4)
    counts, starts = torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    tables = torch.tensor([[1]], dtype=torch.int32)
    attrs = (*geom.attrs().values(), 0, 10000.0)
    torch.ops.mtp.kv_write(k, k, counts, starts, tables, pool_address(pool), 0, *attrs)
    tables[0, 0] = 3
    torch.ops.mtp.kv_write(2 * k, 2 * k, counts, starts, tables, pool_address(pool), 0, *attrs)
    assert torch.equal(pool[0, 0, 1, 0], k[0]) and torch.equal(pool[0, 0, 3, 0], 2 * k[0])


def test_bad_input_is_one_line_value_error() -> None:
    geom = KVPoolGeometry(1, 4, 2, 1, 4)
    pool = allocate_pool(geom)
    one = torch.ones(1, dtype=torch.int32)
    k = torch.randn(2, 1, 4)
    attrs = geom.attrs().values()
    after = torch.zeros(1, dtype=torch.int64)
    bad = [
        (lambda: torch.ops.mtp.kv_write(k, k, one, 2 * one, torch.tensor([[1, 9]], dtype=torch.int32),
                                        pool_address(pool), 0, *attrs, 0, 1.0), "block id 9 .* outside the pool's 4 blocks"),
        (lambda: torch.ops.mtp.kv_write(k, k, one, one, one[None], torch.zeros(1, dtype=torch.int64), 0, *attrs, 0,
                                        1.0), "KV pool address is 0"),
        (lambda: torch.ops.mtp.kv_write(k, k, torch.tensor([3], dtype=torch.int32), one, one[None],
                                        pool_address(pool), 0, *attrs, 0, 1.0), "segments hold 3 rows"),
        (lambda: torch.ops.mtp.paged_attention(k, one, torch.tensor([5], dtype=torch.int32), one[None],
                                               pool_address(pool), after, 0, *attrs, 1.0), "pass wider block tables"),
        (lambda: torch.ops.mtp.paged_attention(k, one.float(), one, one[None], pool_address(pool), after, 0, *attrs,
                                               1.0), "q_counts must be int32 or int64"),
        (lambda: torch.ops.mtp.moe_experts(torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
                                           torch.randn(1, 6, 4), torch.randn(1, 4, 2), 1, 1), "w_down must be"),
    ]  # fmt: skip
    for call, message in bad:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value).strip(), str(err.value)


def test_missing_library_says_how_to_build(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cpp_ops, "_loaded", False)
    monkeypatch.setattr(cpp_ops, "LIBRARY", tmp_path / "libmtp_ops.so")
    with pytest.raises(ImportError, match=r"^mtp: the C\+\+ plugin library is not built; run `make install`$"):
        cpp_ops.load()


def _thread_cpu_ticks() -> dict[int, int]:
    """Each thread of this process -> its user + system CPU time so far, in clock ticks (/proc)."""
    from pathlib import Path

    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def _with_threads(n: int, fn):
    """fn() with torch (and so the kernels' at::parallel_for) on n threads; the count is restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


def _other_threads_share(call, seconds: float = 1.0) -> tuple[float, dict[int, int]]:
    """The share of this process's CPU ticks that threads other than the caller spent while `call` ran back to back
    for `seconds` (wall; ~100 ticks of 10 ms at full speed, so a 50 % share cannot read as < 20 % by sampling) at 2
    threads, after one call that starts the OpenMP pool and a pause in which its spinning workers go to sleep."""
    import threading
    import time

    def run():
        call()
        time.sleep(0.2)
        me = threading.get_native_id()
        before = _thread_cpu_ticks()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            call()
        after = _thread_cpu_ticks()
        delta = {t: after[t] - before.get(t, 0) for t in after}
        return sum(d for t, d in delta.items() if t != me) / max(sum(delta.values()), 1), delta

    return _with_threads(2, run)


def _big_attention(dtype: torch.dtype = torch.float32):
    """GQA attention big enough to split (common.h kMinThreadWork): 4 requests of equal cost x 4 KV heads of 128,
    group 2, 1 to 4 rows over 384 positions -> (call(q, counts, kv_lens, tables), q, metadata, pool)."""
    geom = KVPoolGeometry(1, 1 + 4 * 25, 16, 4, 128, DTYPE_CODES[dtype])
    pool = filled_pool(geom, seed=11)
    gen = torch.Generator().manual_seed(12)
    tables = (1 + torch.randperm(100, generator=gen)).to(torch.int32).view(4, 25)
    counts, lens = torch.tensor([1, 4, 2, 3], dtype=torch.int32), torch.tensor([384, 390, 385, 400], dtype=torch.int32)
    q = torch.randn(11, 8, 128, generator=gen).to(dtype)
    after = torch.zeros(1, dtype=torch.int64)

    def call(qs, c, lens_, tabs):
        return torch.ops.mtp.paged_attention(qs, c, lens_, tabs, pool_address(pool), after, 0, *geom.attrs().values(),
                                             128**-0.5)  # fmt: skip

    return call, q, (counts, lens, tables), pool


@pytest.mark.parametrize("isa", ["generic", "best"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_does_not_depend_on_the_thread_count(isa: str, dtype: torch.dtype) -> None:
    """Paged (GQA) and MLA attention at sizes that split over (request, KV head, query chunk): 1 and 2 threads give
    bit-identical outputs, equal to the reference, and a request alone (one thread's item set) equals its rows in
    the batch, the last verify row equals a decode row."""
    call, q, (counts, lens, tables), pool = _big_attention(dtype)
    one = _with_threads(1, lambda: call(q, counts, lens, tables))
    two = _with_threads(2, lambda: call(q, counts, lens, tables))
    assert torch.equal(one, two)
    expected = paged_attention_ref(pool, q, counts, lens, tables, 0, 128**-0.5)
    torch.testing.assert_close(two.float(), expected.float(), atol=tolerance(dtype), rtol=0)
    alone = _with_threads(2, lambda: call(q[1:5], counts[1:2], lens[1:2], tables[1:2]))
    assert torch.equal(alone, two[1:5])
    decode = _with_threads(2, lambda: call(q[4:5], counts[:1], lens[1:2], tables[1:2]))
    assert torch.equal(decode, two[4:5])

    mgeom = KVPoolGeometry(1, 1 + 2 * 20, 16, 1, 576, DTYPE_CODES[dtype], kv_kind=1)
    mpool = filled_pool(mgeom, seed=13)
    gen = torch.Generator().manual_seed(14)
    mq = torch.randn(5, 16, 576, generator=gen).to(dtype)
    mc, ml = torch.tensor([1, 4], dtype=torch.int32), torch.tensor([300, 310], dtype=torch.int32)
    mt = (1 + torch.randperm(40, generator=gen)).to(torch.int32).view(2, 20)
    after = torch.zeros(1, dtype=torch.int64)

    def mla(qs, c, lens_, tabs):
        return torch.ops.mtp.mla_paged_attention(qs, c, lens_, tabs, pool_address(mpool), after, 0,
                                                 *mgeom.attrs().values(), 64, 0.05)  # fmt: skip

    m1, m2 = (_with_threads(n, lambda: mla(mq, mc, ml, mt)) for n in (1, 2))
    assert torch.equal(m1, m2)
    torch.testing.assert_close(m2.float(), mla_paged_attention_ref(mpool, mq, mc, ml, mt, 0, 64, 0.05).float(),
                               atol=tolerance(dtype), rtol=0)  # fmt: skip
    assert torch.equal(_with_threads(2, lambda: mla(mq[4:5], mc[:1], ml[1:], mt[1:])), m2[4:5])


@pytest.mark.parametrize("isa", ["generic", "best"], indirect=True)
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_moe_experts_do_not_depend_on_the_thread_count(isa: str, weights: torch.dtype) -> None:
    """MoE at a size that splits over (expert, 128-row block): 1 and 2 threads bit-identical, equal to the
    reference; a token alone equals its row of the batch at 2 threads; offset 2 (other ranks' experts give 0)."""
    x, ids, w, w_gate_up, w_down = _moe_inputs(3, 6, 512, 320, 6, 3, torch.float32, weights, torch.int64, 8)
    call = lambda xs, i, ws: torch.ops.mtp.moe_experts_local(xs, i, ws, w_gate_up, w_down, 2)  # noqa: E731
    one, two = (_with_threads(n, lambda: call(x, ids, w)) for n in (1, 2))
    assert torch.equal(one, two)
    torch.testing.assert_close(two, moe_experts_ref(x, ids, w, w_gate_up, w_down, 2), atol=1e-5, rtol=1e-4)
    for t in (0, 5):
        alone = _with_threads(2, lambda t=t: call(x[t : t + 1], ids[t : t + 1], w[t : t + 1]))
        assert torch.equal(alone, two[t : t + 1])


@pytest.mark.parametrize("isa", ["generic", "best"], indirect=True)
def test_moe_experts_fp8_do_not_depend_on_the_thread_count(isa: str) -> None:
    from tests.plugins.test_moe_experts_fp8 import _agrees, _case

    x, ids, tw, gu, sgu, dn, sdn = _case(4, 5, 6, 3, 512, 320)
    call = lambda: torch.ops.mtp.moe_experts_fp8(x, ids, tw, gu, sgu, dn, sdn, 0)  # noqa: E731
    one, two = _with_threads(1, call), _with_threads(2, call)
    assert torch.equal(one, two)
    assert _agrees(two, x, ids, tw, gu, sgu, dn, sdn)


@pytest.mark.parametrize("isa", ["generic", "best"], indirect=True)
def test_moe_experts_int8_do_not_depend_on_the_thread_count(isa: str) -> None:
    from tests.plugins.test_moe_experts_int8 import _agrees, _case

    x, ids, tw, gu, sgu, dn, sdn = _case(4, 5, 6, 3, 512, 320, offset=2)
    call = lambda: torch.ops.mtp.moe_experts_int8(x, ids, tw, gu, sgu, dn, sdn, 2)  # noqa: E731
    one, two = _with_threads(1, call), _with_threads(2, call)
    assert torch.equal(one, two)
    assert _agrees(two, x, ids, tw, gu, sgu, dn, sdn, 2)


@pytest.mark.parametrize("isa", ["generic", "best"], indirect=True)
def test_moe_experts_int4_do_not_depend_on_the_thread_count(isa: str) -> None:
    from tests.plugins.test_moe_experts_int4 import _agrees, _case

    case = _case(4, 5, 6, 3, 512, 320, 64, offset=2)
    call = lambda: torch.ops.mtp.moe_experts_int4(*case, 64, 2)  # noqa: E731
    one, two = _with_threads(1, call), _with_threads(2, call)
    assert torch.equal(one, two)
    assert _agrees(two, *case, group=64, offset=2)


@pytest.mark.parametrize("shared_slots", [False, True])
def test_kv_writes_do_not_depend_on_the_thread_count(shared_slots: bool) -> None:
    """A 3-request prefill of 300 rows (8 KV heads x 128, roped; an MLA latent of 576) splits over rows: the pools
    after 1 and 2 threads are bit-identical and equal to the reference (poisoned pool: nothing else is written).
    shared_slots: the last request's table repeats the first one's blocks, so two rows go to one pool slot (outside
    the contract): the kernel then writes in row order, and the last row wins as in the reference."""
    gen = torch.Generator().manual_seed(21)
    counts, starts = torch.tensor([200, 0, 100], dtype=torch.int32), torch.tensor([0, 5, 40], dtype=torch.int32)
    tables = torch.full((3, 13), -1, dtype=torch.int32)
    tables[0] = 1 + torch.randperm(13, generator=gen).to(torch.int32)
    tables[2, :9] = tables[0, :9] if shared_slots else 14 + torch.arange(9, dtype=torch.int32)
    geom = KVPoolGeometry(1, 23, 16, 8, 128, DTYPE_CODES[torch.bfloat16])
    k, v = torch.randn(302, 8, 128, generator=gen), torch.randn(302, 8, 128, generator=gen)
    expected = torch.full(geom.shape, float("nan"), dtype=geom.dtype)
    n_ref = kv_write_ref(expected, k, v, counts, starts, tables, 0, 64, 1e6)

    def write():
        pool = torch.full(geom.shape, float("nan"), dtype=geom.dtype)
        n = torch.ops.mtp.kv_write(k, v, counts, starts, tables, pool_address(pool), 0, *geom.attrs().values(), 64,
                                   1e6)  # fmt: skip
        return int(n[0]), pool

    (n1, p1), (n2, p2) = _with_threads(1, write), _with_threads(2, write)
    assert n1 == n2 == n_ref == 300 and torch.equal(p1.view(torch.int16), p2.view(torch.int16))
    assert torch.equal(p2.isnan(), expected.isnan())
    torch.testing.assert_close(p2.float().nan_to_num(), expected.float().nan_to_num(), atol=tolerance(geom.dtype),
                               rtol=0)  # fmt: skip

    mgeom = KVPoolGeometry(1, 23, 16, 1, 576, DTYPE_CODES[torch.bfloat16], kv_kind=1)
    latent, inv_freq = torch.randn(302, 576, generator=gen), torch.rand(32, generator=gen)
    mexpected = torch.full(mgeom.shape, float("nan"), dtype=mgeom.dtype)
    mla_kv_write_ref(mexpected, latent, counts, starts, tables, 0, inv_freq, 64, 0.7)

    def mla_write():
        pool = torch.full(mgeom.shape, float("nan"), dtype=mgeom.dtype)
        torch.ops.mtp.mla_kv_write(latent, counts, starts, tables, pool_address(pool), inv_freq, 0,
                                   *mgeom.attrs().values(), 64, 0.7)  # fmt: skip
        return pool

    m1, m2 = _with_threads(1, mla_write), _with_threads(2, mla_write)
    assert torch.equal(m1.view(torch.int16), m2.view(torch.int16)) and torch.equal(m2.isnan(), mexpected.isnan())
    torch.testing.assert_close(m2.float().nan_to_num(), mexpected.float().nan_to_num(), atol=tolerance(mgeom.dtype),
                               rtol=0)  # fmt: skip


def _gdn_call(seed: int, counts, starts, reads, writes, slots: int = 8):
    """mtp::gdn_step and gdn_step_ref at a size that splits over (request, value head): Hk 2 x Dk 64, Hv 4 x Dv 64,
    on copies of one pool -> (op outputs, reference outputs), each (out, conv pool, ssm pool)."""
    from plugins.gdn_pool import GDNPoolGeometry, address
    from plugins.reference import gdn_step_ref

    hk, dk, hv, dv, kk = 2, 64, 4, 64, 4
    c = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    mixed, b, a = torch.randn(n, c, generator=g), torch.randn(n, hv, generator=g), torch.randn(n, hv, generator=g)
    w, a_log, dt = 0.3 * torch.randn(c, kk, generator=g), 0.5 * torch.randn(hv, generator=g), torch.randn(hv)
    conv, ssm = torch.randn(slots, c, kk - 1, generator=g), 0.1 * torch.randn(slots, hv, dk, dv, generator=g)
    meta = [torch.tensor(v, dtype=torch.int32) for v in (counts, starts, reads, writes)]
    geom = GDNPoolGeometry(1, slots, c, kk, hk, hv, dk, dv)

    def op():
        cp, sp = conv.clone(), ssm.clone()
        out = torch.ops.mtp.gdn_step(mixed, b, a, *meta, address(cp), address(sp), w, a_log, dt, **geom.attrs(0))
        return out, cp, sp

    cr, sr = conv.clone(), ssm.clone()
    ref = gdn_step_ref(mixed, b, a, *meta, cr, sr, w, a_log, dt, hk, dk, dv)
    return op, (ref, cr, sr)


@pytest.mark.parametrize("shared_slot", [False, True])
def test_gdn_step_does_not_depend_on_the_thread_count(shared_slot: bool) -> None:
    """A fresh 6-row prefill, a 3-row verify from slot 2 (every row stored) and a decode from slot 5: 1 and 2 threads
    give bit-identical outputs and pools, equal to the reference. shared_slot: the decode reads the slot the prefill
    writes, so requests must run in order (the reference's semantics; the kernel then splits heads only)."""
    writes = [-1] * 5 + [0] + [3, 4, 7] + [6]
    op, ref = _gdn_call(5, [6, 3, 1], [0, 9, 20], [1, 2, 0 if shared_slot else 5], writes)
    one, two = _with_threads(1, op), _with_threads(2, op)
    for a_, b_, r_ in zip(one, two, ref, strict=True):
        assert torch.equal(a_, b_)
        torch.testing.assert_close(b_, r_, atol=1e-5, rtol=1e-5)


def test_kernels_run_on_the_threads_torch_is_given() -> None:
    """The kernels split their work with at::parallel_for, a header template whose OpenMP backend is a `#pragma omp
    parallel`: built without -fopenmp (as the library was until round 10) it ran every kernel on the calling thread
    alone. With two threads, another thread must do a share of a weight-bound linear, of a paged attention over 4
    equal requests x 4 KV heads, of an MLA decode row (its heads split) and of a MoE over 4 experts (each item set is about half the work, so the call
    cannot return without it: this holds on a loaded machine too)."""
    w = torch.randn(4096, 4096).to(torch.bfloat16)
    x = torch.randn(1, 4096)
    share, delta = _other_threads_share(lambda: torch.ops.mtp.linear_bf16(x, w, None))
    assert share >= 0.2, f"linear_bf16: CPU ticks per thread during the calls: {delta}"

    geom = KVPoolGeometry(1, 1 + 4 * 64, 16, 4, 128)
    pool = filled_pool(geom, seed=1)
    tables = torch.arange(1, 1 + 4 * 64, dtype=torch.int32).view(4, 64)
    counts, lens = torch.full((4,), 2, dtype=torch.int32), torch.full((4,), 1024, dtype=torch.int32)
    q, after = torch.randn(8, 8, 128), torch.zeros(1, dtype=torch.int64)
    attend = lambda: torch.ops.mtp.paged_attention(q, counts, lens, tables, pool_address(pool), after, 0,  # noqa: E731
                                                   *geom.attrs().values(), 0.1)  # fmt: skip
    share, delta = _other_threads_share(attend)
    assert share >= 0.2, f"paged_attention: CPU ticks per thread during the calls: {delta}"

    # an MLA decode row: one request, one latent "KV head": the 16 heads of its group are split into parts
    mgeom = KVPoolGeometry(1, 1 + 128, 16, 1, 576, kv_kind=1)
    mpool = filled_pool(mgeom, seed=2)
    mq, one = torch.randn(1, 16, 576), torch.ones(1, dtype=torch.int32)
    mtables = torch.arange(1, 129, dtype=torch.int32).view(1, 128)
    mla = lambda: torch.ops.mtp.mla_paged_attention(mq, one, one * 2048, mtables,  # noqa: E731
                                                    pool_address(mpool), after, 0, *mgeom.attrs().values(), 64, 0.05)
    share, delta = _other_threads_share(mla)
    assert share >= 0.2, f"mla_paged_attention: CPU ticks per thread during the calls: {delta}"

    xs, ids, tw, w_gate_up, w_down = _moe_inputs(2, 4, 1024, 512, 4, 2, torch.float32, torch.bfloat16, torch.int64, 4)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])  # every expert 2 pairs: equal items
    moe = lambda: torch.ops.mtp.moe_experts(xs, ids, tw, w_gate_up, w_down, 4, 1)  # noqa: E731
    share, delta = _other_threads_share(moe)
    assert share >= 0.2, f"moe_experts: CPU ticks per thread during the calls: {delta}"


def test_small_calls_stay_on_the_calling_thread() -> None:
    """Decode of models/deep (8 q / 2 KV heads of 32 over 128 positions; 8 experts of 256 x 96, top-2) is below
    common.h's kMinThreadWork per thread: waking a second thread would cost more than it saves, so the other
    threads stay idle even with 2 threads."""
    geom = KVPoolGeometry(1, 10, 16, 2, 32)
    pool = filled_pool(geom, seed=3)
    tables = torch.arange(1, 10, dtype=torch.int32).view(1, 9)
    one, lens = torch.ones(1, dtype=torch.int32), torch.full((1,), 129, dtype=torch.int32)
    q, after = torch.randn(1, 8, 32), torch.zeros(1, dtype=torch.int64)
    xs, ids, tw, w_gate_up, w_down = _moe_inputs(2, 1, 256, 96, 8, 2, torch.float32, torch.bfloat16, torch.int64, 8)

    def step():
        torch.ops.mtp.paged_attention(q, one, lens, tables, pool_address(pool), after, 0, *geom.attrs().values(), 0.1)
        torch.ops.mtp.moe_experts(xs, ids, tw, w_gate_up, w_down, 8, 1)

    share, delta = _other_threads_share(step)
    assert share <= 0.1 and sum(delta.values()) > 0, f"CPU ticks per thread during the calls: {delta}"
