"""`python -m plugins.gpu_check`: the Triton kernels on a CUDA device vs the reference, plus achieved bandwidth.

GQA (plugins/triton_kernels.py) and MLA latent (plugins/mla_triton.py) cases print max errors and GB/s; DeepSeek
Sparse Attention (plugins/dsa_triton.py) cases print the rows whose top-k set differs from the reference's, the sparse
attention's max error and the time per call. Never run here (no GPU): written for `make gpu-check` on a CUDA machine.

Prints one JSON object. Without a CUDA device it prints {"skipped": "no CUDA device: skipping GPU check"} and
exits 0. Exit status 1 when a kernel disagrees with plugins/reference.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from plugins.dsa_reference import dsa_index_topk_ref, dsa_sparse_attention_ref
from plugins.dsa_triton import dsa_index_topk_triton, dsa_sparse_attention_triton
from plugins.kv_pool import KVPoolGeometry, allocate_pool
from plugins.mla_triton import mla_kv_write_triton, mla_paged_attention_triton
from plugins.reference import kv_write_ref, mla_kv_write_ref, mla_paged_attention_ref, paged_attention_ref
from plugins.triton_kernels import kv_write_triton, paged_attention_triton


def timed(fn: Any) -> float:
    """Seconds per call: 3 warm-up calls, then the mean of 20 between CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / 1e3


def _tables(geom: KVPoolGeometry, counts: list[int], starts: list[int], gen: torch.Generator) -> torch.Tensor:
    per_req = max(s + c for s, c in zip(starts, counts, strict=True)) // geom.block_size + 1
    ids = torch.randperm(geom.num_blocks - 1, generator=gen)[: per_req * len(counts)] + 1
    return ids.reshape(len(counts), per_req).to(torch.int32)


def _mla_case(geom: KVPoolGeometry, counts: list[int], starts: list[int], heads: int, rope_dim: int,
              seed: int) -> dict[str, Any]:  # fmt: skip
    """The MLA kernels (plugins/mla_triton.py) vs mla_*_ref: YaRN-scaled rope in the write, absorbed attention."""
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    pool = allocate_pool(geom, dev)
    pool.normal_(generator=torch.Generator(device=dev).manual_seed(seed))
    tables = _tables(geom, counts, starts, gen)
    rows = sum(counts)
    latent = torch.randn(rows, geom.head_dim, generator=gen).to(geom.dtype)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope_dim, 2).float() / rope_dim)
    c, s = torch.tensor(counts, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
    ref_pool = pool.cpu()
    mla_kv_write_ref(ref_pool, latent, c, s, tables, 0, inv_freq, rope_dim, 1.2)
    d_args = (c.to(dev), s.to(dev), tables.to(dev))
    written = mla_kv_write_triton(latent.to(dev), *d_args, pool.data_ptr(), inv_freq.to(dev), 0, geom, rope_dim, 1.2)
    write_err = (pool.cpu().float() - ref_pool.float()).abs().max().item()
    q = torch.randn(rows, heads, geom.head_dim, generator=gen).to(geom.dtype)
    kv_lens = s + c
    scale = 192**-0.5
    ref = mla_paged_attention_ref(ref_pool, q, c, kv_lens, tables, 0, rope_dim, scale)
    qd, kvd, ld, fd = q.to(dev), kv_lens.to(dev), latent.to(dev), inv_freq.to(dev)
    out = mla_paged_attention_triton(qd, d_args[0], kvd, d_args[2], pool.data_ptr(), 0, geom, rope_dim, scale)
    attn_err = (out.cpu().float() - ref.float()).abs().max().item()
    t_write = timed(lambda: mla_kv_write_triton(ld, *d_args, pool.data_ptr(), fd, 0, geom, rope_dim, 1.2))
    t_attn = timed(lambda: mla_paged_attention_triton(qd, d_args[0], kvd, d_args[2], pool.data_ptr(), 0, geom,
                                                      rope_dim, scale))  # fmt: skip
    elem = pool.element_size()
    visible = sum(sum(s0 + j + 1 for j in range(c0)) for s0, c0 in zip(starts, counts, strict=True))
    head_tiles = -(-heads // 16)  # each 16-head tile of a query row reads the visible latents once
    attn_bytes = visible * geom.head_dim * elem * head_tiles + (q.numel() + out.numel()) * elem
    tol = 1e-3 if geom.dtype == torch.float32 else 3e-2
    return {
        "kind": "mla", "dtype": str(geom.dtype), "heads": heads, "rows": rows, "written": int(written.item()),
        "write_max_err": write_err, "attn_max_err": attn_err, "ok": write_err <= tol and attn_err <= tol,
        "kv_write_gbps": 2 * rows * geom.head_dim * elem / t_write / 1e9, "attention_gbps": attn_bytes / t_attn / 1e9,
    }  # fmt: skip


def _dsa_case(geom: KVPoolGeometry, counts: list[int], starts: list[int], heads: int, topk: int, seed: int,
              dev: str = "cuda") -> dict[str, Any]:  # fmt: skip
    """The DSA kernels (plugins/dsa_triton.py) vs plugins/dsa_reference.py: GLM-5's indexer (32 heads of 128 over
    plane 1) and absorbed attention over plane 0 (64 rope + 512 c_kv) of the reference's selection."""
    gen = torch.Generator().manual_seed(seed)
    pool = allocate_pool(geom, dev)
    pool.normal_(generator=torch.Generator(device=dev).manual_seed(seed))
    tables = _tables(geom, counts, starts, gen)
    rows, scale = sum(counts), 128**-0.5
    c = torch.tensor(counts, dtype=torch.int32)
    kv_lens = torch.tensor([s0 + c0 for s0, c0 in zip(starts, counts, strict=True)], dtype=torch.int32)
    q_idx, w = torch.randn(rows, 32, 128, generator=gen), torch.randn(rows, 32, generator=gen)
    q = torch.randn(rows, heads, geom.head_dim, generator=gen).to(geom.dtype)
    ref_pool = pool.cpu()
    want = dsa_index_topk_ref(ref_pool, q_idx, w, c, kv_lens, tables, 1, topk, scale)
    ref = dsa_sparse_attention_ref(ref_pool, q, c, tables, want, 0, 64, 0.05)
    cd, kvd, td, qid, wd, qd, seld = (t.to(dev) for t in (c, kv_lens, tables, q_idx, w, q, want))

    def select() -> torch.Tensor:
        return dsa_index_topk_triton(qid, wd, cd, kvd, td, pool.data_ptr(), 1, geom, topk, scale)

    def attend() -> torch.Tensor:  # over the reference's selection: its error is the attention's own
        return dsa_sparse_attention_triton(qd, cd, seld, td, pool.data_ptr(), 0, geom, 64, 0.05)

    got = select().cpu()
    differ = sum(sorted(a.tolist()) != sorted(b.tolist()) for a, b in zip(got, want, strict=True))
    ascending = all(r[r >= 0].tolist() == sorted(r[r >= 0].tolist()) for r in got)
    attn_err = (attend().cpu().float() - ref.float()).abs().max().item()
    tol = 1e-3 if geom.dtype == torch.float32 else 3e-2
    timing = {"topk_ms": timed(select) * 1e3, "sparse_attention_ms": timed(attend) * 1e3} if dev == "cuda" else {}
    return {"kind": "dsa", "dtype": str(geom.dtype), "rows": rows, "topk": topk, "topk_rows_differing": differ,
            "ascending": ascending, "attn_max_err": attn_err, "ok": differ == 0 and ascending and attn_err <= tol,
            **timing}  # fmt: skip


def _case(geom: KVPoolGeometry, counts: list[int], starts: list[int], group: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    pool = allocate_pool(geom, dev)
    pool.normal_(generator=torch.Generator(device=dev).manual_seed(seed))
    tables = _tables(geom, counts, starts, gen)
    rows = sum(counts)
    k = torch.randn(rows, geom.num_kv_heads, geom.head_dim, generator=gen).to(geom.dtype)
    v = torch.randn_like(k)
    c, s = torch.tensor(counts, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
    ref_pool = pool.cpu()
    kv_write_ref(ref_pool, k, v, c, s, tables, 0, rope_dim=geom.head_dim // 2)
    written = kv_write_triton(k.to(dev), v.to(dev), c.to(dev), s.to(dev), tables.to(dev), pool.data_ptr(), 0, geom,
                              geom.head_dim // 2, 10000.0)  # fmt: skip
    write_err = (pool.cpu().float() - ref_pool.float()).abs().max().item()
    q = torch.randn(rows, geom.num_kv_heads * group, geom.head_dim, generator=gen).to(geom.dtype)
    kv_lens = s + c
    scale = geom.head_dim**-0.5
    ref = paged_attention_ref(ref_pool, q, c, kv_lens, tables, 0, scale)
    out = paged_attention_triton(q.to(dev), c.to(dev), kv_lens.to(dev), tables.to(dev), pool.data_ptr(), 0, geom, scale)
    attn_err = (out.cpu().float() - ref.float()).abs().max().item()

    args = (c.to(dev), s.to(dev), tables.to(dev))
    kd, vd, qd, kvd = k.to(dev), v.to(dev), q.to(dev), kv_lens.to(dev)
    t_write = timed(lambda: kv_write_triton(kd, vd, *args, pool.data_ptr(), 0, geom, geom.head_dim // 2, 10000.0))
    t_attn = timed(lambda: paged_attention_triton(qd, args[0], kvd, args[2], pool.data_ptr(), 0, geom, scale))
    elem = pool.element_size()
    row_bytes = geom.num_kv_heads * geom.head_dim * elem
    write_bytes = 4 * rows * row_bytes  # read k, v; write K, V
    # Each query row re-reads its visible keys/values (no cross-row reuse in this kernel); count what it reads.
    visible = sum(sum(s0 + j + 1 for j in range(c0)) for s0, c0 in zip(starts, counts, strict=True))
    attn_bytes = 2 * visible * row_bytes + 2 * q.numel() * elem
    tol = 1e-3 if geom.dtype == torch.float32 else 3e-2
    return {
        "kind": "gqa", "dtype": str(geom.dtype), "group": group, "rows": rows, "written": int(written.item()),
        "write_max_err": write_err, "attn_max_err": attn_err, "ok": write_err <= tol and attn_err <= tol,
        "kv_write_gbps": write_bytes / t_write / 1e9, "attention_gbps": attn_bytes / t_attn / 1e9,
    }  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: skipping GPU check"}))
        return 0
    cases = []
    for code, group in [(0, 1), (1, 4), (2, 2)]:
        geom = KVPoolGeometry(2, 4096, 16, 8, 128, code)
        cases.append(_case(geom, [1] * 64, [200 + 7 * i for i in range(64)], group, seed=code))  # decode-like
        cases.append(_case(geom, [512, 0, 300], [0, 5, 17], group, seed=10 + code))  # prefill-like
    for code in (0, 2):
        # DeepSeek-V3 / GLM-4.7-Flash latent: 64 rope dims + kv_lora_rank 512; 16 heads (128 over 8 TP ranks).
        mla = KVPoolGeometry(2, 2048, 16, 1, 64 + 512, code, kv_kind=1)
        cases.append(_mla_case(mla, [1] * 64, [200 + 7 * i for i in range(64)], 16, 64, seed=20 + code))
        cases.append(_mla_case(mla, [256, 0, 100], [0, 5, 17], 16, 64, seed=30 + code))
    for code in (0, 2):
        dsa = KVPoolGeometry(2, 2048, 64, 1, 64 + 512, code, kv_kind=1)  # plane 0 latents, plane 1 indexer keys
        cases.append(_dsa_case(dsa, [1] * 16, [700 + 37 * i for i in range(16)], 16, 512, seed=40 + code))  # decode
        cases.append(_dsa_case(dsa, [96, 0, 40], [0, 5, 600], 16, 512, seed=50 + code))  # a prefill below topk, a chunk
    report = {"device": torch.cuda.get_device_name(), "cases": cases, "ok": all(c["ok"] for c in cases)}
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
