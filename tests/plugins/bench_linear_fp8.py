"""mtp::linear_fp8, mtp::linear_int8 and mtp::linear_int4 against mtp::linear_bf16 and fp32 MKL at decode shapes: cold weights, interleaved rounds, medians.

    PYTHONPATH=$PWD OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m tests.plugins.bench_linear_fp8 --rounds 7
    PYTHONPATH=$PWD .venv/bin/python -m tests.plugins.bench_linear_fp8 --conversions   # e4m3 -> fp32 candidates

Each candidate multiplies x [M, K] by `--count` distinct weights of [N, K] in turn (together several times the
last-level cache, so every weight comes from DRAM, as in a decode step of a large model):
  fp8-op    torch.ops.mtp.linear_fp8 on float8_e4m3fn weights + 128x128 block scales (1 byte per weight)
  int8-op   torch.ops.mtp.linear_int8 on int8 weights + one fp32 scale per row (1 byte per weight + 4 per row;
            plugins/reference.py quantize_int8, what `mtp-build --quantize int8` stores)
  int4-op   torch.ops.mtp.linear_int4 on packed int4 weights + one fp32 scale per 32 inputs of a row (0.5 bytes per
            weight + 4 per group: 0.625; plugins/reference.py quantize_int4)
  bf16-op   torch.ops.mtp.linear_bf16 on bf16 weights (2 bytes)
  fp32      F.linear on fp32 weights stored [N, K] (MKL, 4 bytes)
for every shape, row count and thread count asked. Rounds rotate the order; a candidate's round time is the median
time per matrix (wall, or process CPU with --clock cpu) over `--iters` passes over its weights. Prints microseconds per matrix, the weight read rate
(GB/s of the bytes each candidate stores, scales included) and the ratios fp8 / fp32, fp8 / bf16, int8 / fp8, int8 / bf16, int4 / int8, int4 / bf16.

`--moe` times the routed experts instead, GLM-4.5-Air-like by default (`--hidden` 4096, `--inter` 1408, `--experts`
local experts, top-`--top-k` per token): mtp::moe_experts_int4 on group-wise int4 experts (`mtp-build --quantize
int4`'s, group `--int4-group`, 64 by default as mtp-build's), mtp::moe_experts_int8 on int8 experts + row scales
(`mtp-build --quantize int8`'s) and mtp::moe_experts_fp8 on e4m3 experts + block scales against
mtp::moe_experts_local on bf16 and on fp32 experts, `--layers` distinct expert sets in turn (cold), same routing for all, at each `--threads` count; GB/s of the
bytes the routed experts store in each form, scales included. Only the routed experts get memory, so `--experts 64`
costs what the routing touches:

    PYTHONPATH=$PWD .venv/bin/python -m tests.plugins.bench_linear_fp8 --moe --threads 1 --experts 64 --top-k 8 \
        --layers 1 --inter 1536 --clock cpu --rounds 7

`--conversions` compiles and runs a standalone C++ microbenchmark (g++, the library's flags) of three ways to turn
e4m3 bytes into scaled fp32 inside a one-row dot product, on AVX-512 and AVX2 (each only if the CPU has it):
  fp16      the byte as the fp16 of q * 2^-8 (shift + mask), F16C vcvtph2ps, times s * 256, NaN bytes fixed lane by
            lane; "+ row NaN scan": without that fix, the row scanned for NaN bytes first (what the kernels do)
  fp32bits  the byte as the fp32 bits of q * 2^-120 (shift + mask; subnormal q become fp32 denormals), times s * 2^120
  gather    a 256-entry fp32 table read with a gather instruction, times s
  scalar    the portable table loop
It checks every byte value against the table first, then times a cold 4096 x 4096 pass and a hot 256 x 1024 one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import plugins.cpp_ops  # noqa: F401  (torch.ops.mtp.linear_fp8 / linear_bf16)
from plugins.reference import INT4_GROUP, dequantize_fp8_ref, quantize_int4, quantize_int8


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax per 128 x 128 block / 448, as the releases (and models.fp8.quantize) do it."""
    n, k = w.shape
    r, c = -(-n // 128), -(-k // 128)
    pad = torch.zeros(r * 128, c * 128)
    pad[:n, :k] = w
    blocks = pad.view(r, 128, c, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(r * 128, c * 128)
    return q[:n, :k].contiguous(), scale


def bench_ops(a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    print(f"isa {plugins.cpp_ops.cpu_isa()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, {a.clock} "
          f"time, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| N x K | threads | M | fp8-op us (GB/s) | int8-op us (GB/s) | int4-op us (GB/s) | bf16-op us (GB/s) "
          "| fp32 us (GB/s) | fp8 / fp32 | fp8 / bf16 | int8 / fp8 | int8 / bf16 | int4 / int8 | int4 / bf16 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        count = max(2, -(-a.cold_bytes // (n * k)))  # the fp8 set alone is cold_bytes: several times the LLC
        fp8 = [_quantize(torch.randn(n, k) * 0.02) for _ in range(count)]
        full = [dequantize_fp8_ref(q, s) for q, s in fp8]
        low = [w.bfloat16() for w in full]
        int8 = [quantize_int8(w) for w in full]
        int4 = [quantize_int4(w) for w in full]
        cands: dict[str, tuple[int, list, Callable[..., torch.Tensor]]] = {  # bytes per matrix, the weights, the call
            "fp8-op": (n * k + 4 * fp8[0][1].numel(), fp8, lambda x, w: torch.ops.mtp.linear_fp8(x, w[0], w[1], None)),
            "int8-op": (n * k + 4 * n, int8, lambda x, w: torch.ops.mtp.linear_int8(x, w[0], w[1], None)),
            "int4-op": (n * k // 2 + 4 * n * (k // INT4_GROUP), int4,
                        lambda x, w: torch.ops.mtp.linear_int4(x, w[0], w[1], INT4_GROUP, None)),
            "bf16-op": (2 * n * k, low, lambda x, w: torch.ops.mtp.linear_bf16(x, w, None)),
            "fp32": (4 * n * k, full, lambda x, w: F.linear(x, w)),
        }
        for threads in a.threads:
            torch.set_num_threads(threads)
            for m in a.rows:
                x = torch.randn(m, k)
                for _, weights, fn in cands.values():  # warm-up: first calls allocate, MKL picks its kernels
                    fn(x, weights[0])
                times: dict[str, list[float]] = {c: [] for c in cands}
                names = list(cands)
                for r in range(a.rounds):
                    for c in names[r % len(names):] + names[: r % len(names)]:
                        _, weights, fn = cands[c]
                        per = []
                        for _ in range(a.iters):
                            t0 = clock()
                            for w in weights:
                                fn(x, w)
                            per.append((clock() - t0) / count)
                        times[c].append(statistics.median(per))
                med = {c: statistics.median(v) for c, v in times.items()}
                cells = [f"{med[c] * 1e6:.0f} ({size / med[c] / 1e9:.1f})" for c, (size, _, _) in cands.items()]
                ratios = [("fp8-op", "fp32"), ("fp8-op", "bf16-op"), ("int8-op", "fp8-op"), ("int8-op", "bf16-op"),
                          ("int4-op", "int8-op"), ("int4-op", "bf16-op")]
                print(f"| {n} x {k} | {threads} | {m} | " + " | ".join(cells) + " | " +
                      " | ".join(f"{med[a] / med[b]:.2f}" for a, b in ratios) + " |", flush=True)  # fmt: skip


def _expert_set(e: int, h: int, inter: int, used: list[int], group: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """One layer's e experts in every stored form: fp8 (e4m3 bits + 128 x 128 block scales, gate and up each blocked on
    their own, as the releases ship them), int8 / int4 (plugins/reference.py quantize_int8 / quantize_int4 with
    `group` of the fp8 experts' values: what `mtp-build --quantize int8` / `int4` would store), and bf16 / fp32 of the
    fp8 values. Only the `used` experts (the ones the
    routing picks) get values: the kernels read no other expert, so the rest stay allocated but untouched (no memory)
    and e can be a real model's. Their scales are 1, so the fp8 kernel's scale scan passes as for a real layer."""
    b = lambda n: -(-n // 128)  # noqa: E731
    out = {
        "fp8": (torch.empty(e, 2 * inter, h, dtype=torch.uint8), torch.ones(e, 2 * b(inter), b(h)),
                torch.empty(e, h, inter, dtype=torch.uint8), torch.ones(e, b(h), b(inter))),
        "int8": (torch.empty(e, 2 * inter, h, dtype=torch.int8), torch.ones(e, 2 * inter),
                 torch.empty(e, h, inter, dtype=torch.int8), torch.ones(e, h)),
        "int4": (torch.empty(e, 2 * inter, h // 2, dtype=torch.uint8), torch.ones(e, 2 * inter, h // group),
                 torch.empty(e, h, inter // 2, dtype=torch.uint8), torch.ones(e, h, inter // group)),
        "bf16": (torch.empty(e, 2 * inter, h, dtype=torch.bfloat16), torch.empty(e, h, inter, dtype=torch.bfloat16)),
        "fp32": (torch.empty(e, 2 * inter, h), torch.empty(e, h, inter)),
    }  # fmt: skip
    for x in used:
        parts = [_quantize(torch.randn(r, c) * 0.02) for r, c in ((inter, h), (inter, h), (h, inter))]
        gu_q, gu_s = torch.cat([parts[0][0], parts[1][0]]), torch.cat([parts[0][1], parts[1][1]])
        full_gu = torch.cat([dequantize_fp8_ref(q, s) for q, s in parts[:2]])
        full_dn = dequantize_fp8_ref(*parts[2])
        for form, values in (("fp8", (gu_q.view(torch.uint8), gu_s, parts[2][0].view(torch.uint8), parts[2][1])),
                             ("int8", (*quantize_int8(full_gu), *quantize_int8(full_dn))),
                             ("int4", (*quantize_int4(full_gu, group), *quantize_int4(full_dn, group))),
                             ("bf16", (full_gu.bfloat16(), full_dn.bfloat16())), ("fp32", (full_gu, full_dn))):
            for dst, v in zip(out[form], values, strict=True):
                dst[x] = v
    return out


def bench_moe(a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    h, inter, e = a.hidden, a.inter, a.experts
    print(f"isa {plugins.cpp_ops.cpu_isa()}, {a.clock} time, load average {os.getloadavg()[0]:.1f}; hidden {h}, "
          f"expert width {inter}, {e} experts, top-{a.top_k}, {a.layers} expert sets")  # fmt: skip
    routes = {t: (torch.randn(t, h), torch.stack([torch.randperm(e)[: a.top_k] for _ in range(t)]),
                  torch.rand(t, a.top_k)) for t in a.rows}  # fmt: skip
    used = sorted(set(torch.cat([ids.flatten() for _, ids, _ in routes.values()]).tolist()))
    sets = [_expert_set(e, h, inter, used, a.int4_group) for _ in range(a.layers)]
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    calls = {
        "int4": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_int4(x, ids, tw, *w, a.int4_group, 0),
        "int8": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_int8(x, ids, tw, *w, 0),
        "fp8": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_fp8(x, ids, tw, *w, 0),
        "bf16": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_local(x, ids, tw, *w, 0),
        "fp32": lambda x, ids, tw, w: torch.ops.mtp.moe_experts_local(x, ids, tw, *w, 0),
    }
    # bytes one expert stores in each form, scales included (what a call reads per expert it routes to)
    weights = 3 * h * inter
    per_expert = {"int4": weights // 2 + 4 * weights // a.int4_group, "int8": weights + 4 * (2 * inter + h), "fp8": weights + 4 * int(sets[0]["fp8"][1][0].numel() +
                                                                                    sets[0]["fp8"][3][0].numel()),
                  "bf16": 2 * weights, "fp32": 4 * weights}  # fmt: skip
    ratios = [("int4", "int8"), ("int4", "fp8"), ("int8", "fp8"), ("int8", "bf16"), ("int8", "fp32"), ("fp8", "bf16")]
    print("| threads | tokens | experts read | " + " | ".join(f"{c} us (GB/s)" for c in calls) + " | " +
          " | ".join(f"{x} / {y}" for x, y in ratios) + " |\n|" + "---:|" * (3 + len(calls) + len(ratios)))  # fmt: skip
    for threads in a.threads:
        torch.set_num_threads(threads)
        for t, (x, ids, tw) in routes.items():
            for c in calls:  # warm-up: first calls allocate the kernels' scratch
                calls[c](x, ids, tw, sets[0][c])
            times: dict[str, list[float]] = {c: [] for c in calls}
            names = list(calls)
            for r in range(a.rounds):
                for c in names[r % len(names):] + names[: r % len(names)]:
                    per = []
                    for _ in range(a.iters):
                        t0 = clock()
                        for s in sets:
                            calls[c](x, ids, tw, s[c])
                        per.append((clock() - t0) / len(sets))
                    times[c].append(statistics.median(per))
            med = {c: statistics.median(v) for c, v in times.items()}
            read = len(set(ids.flatten().tolist()))
            cells = [f"{med[c] * 1e6:.0f} ({read * per_expert[c] / med[c] / 1e9:.1f})" for c in calls]
            print(f"| {threads} | {t} | {read} | " + " | ".join(cells) + " | " +
                  " | ".join(f"{med[x] / med[y]:.2f}" for x, y in ratios) + " |", flush=True)  # fmt: skip


CONVERSIONS_CPP = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2")))
#define T2 __attribute__((target("avx2,fma,f16c,bmi2")))
static float LUT[256];
static float e4m3(uint8_t b) {
  int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7f) == 0x7f) return NAN;
  float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return s ? -v : v;
}
// one weight row . x, K a multiple of 128, one scale per 128 columns; two accumulators
T512 float d512_fp16(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < k; b += 128) {
    const __m512 sv = _mm512_set1_ps(s[b / 128] * 256.0f);
    for (int64_t i = b; i < b + 128; i += 32) {
      __m256i h0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i)));
      __m256i h1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i + 16)));
      h0 = _mm256_and_si256(_mm256_slli_epi16(h0, 7), _mm256_set1_epi16((short)0xbf80));
      h1 = _mm256_and_si256(_mm256_slli_epi16(h1, 7), _mm256_set1_epi16((short)0xbf80));
      __mmask16 n0 = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h0, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
      __mmask16 n1 = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h1, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
      __m512 w0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_mask_set1_epi16(h0, n0, -1)), sv);
      __m512 w1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_mask_set1_epi16(h1, n1, -1)), sv);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), w0, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), w1, a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
T512 float d512_fp32bits(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  const __m512i mk = _mm512_set1_epi32(0x87f00000), nk = _mm512_set1_epi32(0x07f00000);
  const __m512 nan = _mm512_set1_ps(NAN);
  for (int64_t b = 0; b < k; b += 128) {
    const __m512 sv = _mm512_set1_ps(s[b / 128] * 0x1p120f);
    for (int64_t i = b; i < b + 128; i += 32) {
      __m512i v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i)));
      __m512i v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i + 16)));
      v0 = _mm512_and_si512(_mm512_slli_epi32(v0, 20), mk);
      v1 = _mm512_and_si512(_mm512_slli_epi32(v1, 20), mk);
      __mmask16 n0 = _mm512_cmpneq_epi32_mask(_mm512_and_si512(v0, nk), nk);
      __mmask16 n1 = _mm512_cmpneq_epi32_mask(_mm512_and_si512(v1, nk), nk);
      __m512 w0 = _mm512_mask_mul_ps(nan, n0, _mm512_castsi512_ps(v0), sv);
      __m512 w1 = _mm512_mask_mul_ps(nan, n1, _mm512_castsi512_ps(v1), sv);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), w0, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), w1, a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
T512 float d512_gather(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < k; b += 128) {
    const __m512 sv = _mm512_set1_ps(s[b / 128]);
    for (int64_t i = b; i < b + 128; i += 32) {
      __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w + i)));
      __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w + i + 16)));
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_mul_ps(_mm512_i32gather_ps(v0, LUT, 4), sv), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_mul_ps(_mm512_i32gather_ps(v1, LUT, 4), sv), a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
T2 static float hs(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
T2 float d2_fp16(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < k; b += 128) {
    const __m256 sv = _mm256_set1_ps(s[b / 128] * 256.0f);
    for (int64_t i = b; i < b + 128; i += 16) {
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i)));
      h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
      h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80)));
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sv), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sv), a1);
    }
  }
  return hs(_mm256_add_ps(a0, a1));
}
T2 float d2_fp32bits(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  const __m256i mk = _mm256_set1_epi32(0x87f00000), nk = _mm256_set1_epi32(0x07f00000);
  for (int64_t b = 0; b < k; b += 128) {
    const __m256 sv = _mm256_set1_ps(s[b / 128] * 0x1p120f);
    for (int64_t i = b; i < b + 128; i += 16) {
      __m256i v0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + i)));
      __m256i v1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + i + 8)));
      v0 = _mm256_and_si256(_mm256_slli_epi32(v0, 20), mk);
      v1 = _mm256_and_si256(_mm256_slli_epi32(v1, 20), mk);
      __m256 w0 = _mm256_or_ps(_mm256_mul_ps(_mm256_castsi256_ps(v0), sv),
                               _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(v0, nk), nk)));
      __m256 w1 = _mm256_or_ps(_mm256_mul_ps(_mm256_castsi256_ps(v1), sv),
                               _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(v1, nk), nk)));
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), w0, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), w1, a1);
    }
  }
  return hs(_mm256_add_ps(a0, a1));
}
T2 float d2_gather(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < k; b += 128) {
    const __m256 sv = _mm256_set1_ps(s[b / 128]);
    for (int64_t i = b; i < b + 128; i += 16) {
      __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + i)));
      __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + i + 8)));
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_mul_ps(_mm256_i32gather_ps(LUT, v0, 4), sv), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_mul_ps(_mm256_i32gather_ps(LUT, v1, 4), sv), a1);
    }
  }
  return hs(_mm256_add_ps(a0, a1));
}
// fp16 without the per-lane NaN fix, one scan of the row for NaN bytes first (what the kernels do)
T512 float d512_fp16_scan(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m512i most = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += 64) {
    const __m512i b = _mm512_loadu_si512(w + i);
    most = _mm512_max_epu8(most, _mm512_add_epi8(b, b));
  }
  if (_mm512_cmpeq_epi8_mask(most, _mm512_set1_epi8((char)0xfe))) return NAN;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < k; b += 128) {
    const __m512 sv = _mm512_set1_ps(s[b / 128] * 256.0f);
    for (int64_t i = b; i < b + 128; i += 32) {
      __m256i h0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i)));
      __m256i h1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i + 16)));
      h0 = _mm256_and_si256(_mm256_slli_epi16(h0, 7), _mm256_set1_epi16((short)0xbf80));
      h1 = _mm256_and_si256(_mm256_slli_epi16(h1, 7), _mm256_set1_epi16((short)0xbf80));
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_mul_ps(_mm512_cvtph_ps(h0), sv), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_mul_ps(_mm512_cvtph_ps(h1), sv), a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
T2 float d2_fp16_scan(const float* x, const uint8_t* w, const float* s, int64_t k) {
  __m256i most = _mm256_setzero_si256();
  for (int64_t i = 0; i < k; i += 32) {
    const __m256i b = _mm256_loadu_si256((const __m256i*)(w + i));
    most = _mm256_max_epu8(most, _mm256_add_epi8(b, b));
  }
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(most, _mm256_set1_epi8((char)0xfe)))) return NAN;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < k; b += 128) {
    const __m256 sv = _mm256_set1_ps(s[b / 128] * 256.0f);
    for (int64_t i = b; i < b + 128; i += 16) {
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i)));
      h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sv), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sv), a1);
    }
  }
  return hs(_mm256_add_ps(a0, a1));
}
float d_scalar(const float* x, const uint8_t* w, const float* s, int64_t k) {
  float a = 0;
  for (int64_t i = 0; i < k; i++) a += x[i] * (LUT[w[i]] * s[i / 128]);
  return a;
}
typedef float (*F)(const float*, const uint8_t*, const float*, int64_t);
int main() {
  for (int i = 0; i < 256; i++) LUT[i] = e4m3(i);
  __builtin_cpu_init();
  const bool a512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool a2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  struct C { const char* name; F f; bool ok; } cs[] = {
    {"avx512 fp16", d512_fp16, a512}, {"avx512 fp16 + row NaN scan", d512_fp16_scan, a512},
    {"avx512 fp32bits", d512_fp32bits, a512}, {"avx512 gather", d512_gather, a512},
    {"avx2 fp16", d2_fp16, a2}, {"avx2 fp16 + row NaN scan", d2_fp16_scan, a2}, {"avx2 fp32bits", d2_fp32bits, a2},
    {"avx2 gather", d2_gather, a2},
    {"scalar table", d_scalar, true}};
  const int64_t K = 4096, N = 4096, NW = 6;
  std::mt19937 rng(1);
  std::vector<uint8_t> W((size_t)NW * N * K);
  for (auto& b : W) { b = rng() & 0xff; if ((b & 0x7f) == 0x7f) b = 0; }
  std::vector<float> S((N / 128) * (K / 128));
  for (auto& s : S) s = std::ldexp(1.0f + (rng() % 1000) / 1000.0f, -10);
  std::vector<float> X(K);
  for (auto& v : X) v = (rng() % 2000) / 1000.0f - 1;
  printf("| conversion | exact (of 256 bytes) | cold 4096 x 4096, us (GB/s) | hot 256 x 1024, us (G weights/s) |\n|---|---:|---:|---:|\n");
  for (auto& c : cs) {
    if (!c.ok) continue;
    int good = 0;
    for (int v = 0; v < 256; v++) {
      std::vector<uint8_t> r(128, 0); std::vector<float> xx(128, 0); r[5] = v; xx[5] = 1; float sc = 0.37f;
      float g = c.f(xx.data(), r.data(), &sc, 128), want = LUT[v] * 0.37f;
      good += g == want || (std::isnan(g) && std::isnan(want));
    }
    std::vector<double> ts; volatile float sink = 0;
    for (int it = 0; it < 5; it++)
      for (int wi = 0; wi < NW; wi++) {
        auto t0 = std::chrono::steady_clock::now(); const uint8_t* w = W.data() + (size_t)wi * N * K; float acc = 0;
        for (int64_t n = 0; n < N; n++) acc += c.f(X.data(), w + n * K, S.data() + (n / 128) * (K / 128), K);
        sink = acc; ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    std::sort(ts.begin(), ts.end()); const double cold = ts[ts.size() / 2];
    ts.clear();
    for (int it = 0; it < 99; it++) {
      auto t0 = std::chrono::steady_clock::now(); float acc = 0;
      for (int64_t n = 0; n < 256; n++) acc += c.f(X.data(), W.data() + n * 1024, S.data(), 1024);
      sink = acc; ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end()); const double hot = ts[ts.size() / 2];
    printf("| %s | %d | %.0f (%.1f) | %.1f (%.2f) |\n", c.name, good, cold * 1e6, N * K / cold / 1e9, hot * 1e6,
           256 * 1024 / hot / 1e9);
    (void)sink;
  }
}
"""


def bench_conversions() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fp8_conversions.cpp", Path(tmp) / "fp8_conversions"
        src.write_text(CONVERSIONS_CPP)
        subprocess.run([os.environ.get("CXX", "g++"), "-O3", "-std=c++20", "-ffp-contract=off", "-fno-math-errno",
                        str(src), "-o", str(exe)], check=True)  # fmt: skip
        print(f"load average {os.getloadavg()[0]:.1f}; 1 thread; medians (cold: 30 passes, hot: 99)")
        subprocess.run([str(exe)], check=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x10944"], help="N x K (output x input)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cold-bytes", type=int, default=96 << 20, help="fp8 bytes of distinct weights per shape")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time (what threads buy) or process CPU time (steadier on a loaded machine, 1 thread)")
    p.add_argument("--conversions", action="store_true", help="the e4m3 -> fp32 conversion microbenchmark (C++)")
    p.add_argument("--moe", action="store_true", help="the routed experts (rows = tokens) instead of the linears")
    p.add_argument("--experts", type=int, default=8, help="--moe: experts per layer (only the routed ones get memory)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096, help="--moe: hidden size (GLM-4.5-Air's by default)")
    p.add_argument("--inter", type=int, default=1408, help="--moe: expert width (GLM-4.5-Air's by default)")
    p.add_argument("--int4-group", type=int, default=64, help="--moe: int4's group (mtp-build's default)")
    p.add_argument("--layers", type=int, default=2, help="--moe: distinct expert sets (2 x 8 experts: 277 MB fp8)")
    a = p.parse_args(argv)
    if a.conversions:
        bench_conversions()
    elif a.moe:
        bench_moe(a)
    else:
        bench_ops(a)


if __name__ == "__main__":
    main()
