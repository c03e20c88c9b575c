// mtp::linear_int8 on CPU: y = x @ dequant(W)^T + b for fp32 activations x [..., K] and a weight-only int8 weight
// with symmetric per-output-channel scales (what `mtp-build --quantize int8` stores; plugins/reference.py
// quantize_int8 makes it): W [N, K] int8, scale [N] fp32, dequant(W)[n, k] = fp32(W[n, k]) * scale[n]. The weight is
// read as its bytes (1 per weight) and converted in registers (sign-extend, int -> fp32, times the row's scale); every
// dequantized weight is rounded once, as plugins/reference.py linear_int8_ref rounds it, and the math is fp32: exact
// up to summation order. (Factoring the scale out of the dot product would save one multiply per weight but round
// differently from the reference and from the tiled path, whose fp32 tile must hold the dequantized values.)
//
// linear_fp8.cpp's structure: few rows (M < kTiledRows: decode, verify, draft) run common.h's quant_rows driver
// over this file's int8 tiles, NR weight rows x MR activation rows in registers, every m-tile of a weight-row block
// back to back (each weight byte comes from DRAM once whatever M is); a row's result is computed by the same
// operations whatever the rest of the batch is (one accumulator per (row, output), one reduction tree), so a decode
// row equals the same row inside a verify. Many rows: dequant_mm.h (a dequantized fp32 tile times MKL).
//
// Paths: AVX-512, AVX2 + FMA, portable C++, chosen at run time by active_isa(). at::parallel_for over blocks of 64
// output features. int8 has no NaN or infinity: a weight is never NaN by itself (the scale can be, as in the reference).
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "dequant_mm.h"

namespace mtp {
namespace {

constexpr int64_t kTiledRows = 16;  // from this many rows on, the dequantized-tile at::mm path (as linear_fp8)

struct Gemv {
  const float* x;     // [M, K] fp32, contiguous
  const int8_t* w;    // [N, K] int8, contiguous
  const float* s;     // [N] fp32, contiguous
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N] fp32
  int64_t m, n, k;
};

// ---- tiles: out[r * NR + j] = x[r] . (fp32(w[j]) * s[j]) for MR activation rows, NR weight rows k apart -----------
// Accumulator lane l of (r, j) sums the columns i with i % width == l in column order, then a fixed reduction (the
// FP8 tiles' trees), so a (row, output) value does not depend on MR, NR or the batch.

// portable: 8 partial sums per dot, (0+1)+(2+3) + (4+5)+(6+7), then the tail (linear_bf16's / linear_fp8's order)
template <int MR, int NR>
inline void int8_tile_generic(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const int8_t* wj = w + j * k;
      const float sj = s[j];
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[r][i + l] * (static_cast<float>(wj[i + l]) * sj);
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < k; ++i) sum += x[r][i] * (static_cast<float>(wj[i]) * sj);
      out[r * NR + j] = sum;
    }
}

MTP_AVX2_TARGET inline __m256 int8x8_avx2(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

template <int MR, int NR>
MTP_AVX2_TARGET inline void int8_tile_avx2(const float* const* x, const int8_t* w, const float* s, int64_t k,
                                           float* out) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if (i % 64 == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kFp8Prefetch), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i));
      const __m256 sv = _mm256_set1_ps(s[j]);
      const __m256 lo = _mm256_mul_ps(int8x8_avx2(b), sv), hi = _mm256_mul_ps(int8x8_avx2(_mm_srli_si128(b, 8)), sv);
      for (int r = 0; r < MR; ++r) {
        acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), lo, acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i + 8), hi, acc[r][j]);
      }
    }
  }
  if (i + 8 <= k) {
    for (int j = 0; j < NR; ++j) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * k + i));
      const __m256 wv = _mm256_mul_ps(int8x8_avx2(b), _mm256_set1_ps(s[j]));
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), wv, acc[r][j]);
    }
    i += 8;
  }
  // fewer than 8 columns left: scalar, in column order
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float sum = fp8_hsum8(acc[r][j]);
      for (int64_t t = i; t < k; ++t) sum += x[r][t] * (static_cast<float>(w[j * k + t]) * s[j]);
      out[r * NR + j] = sum;
    }
}

// 16 int8 (the first lanes of mask m, zeros after) -> 16 fp32 times the scale; masked-off lanes stay 0 (not 0 * s,
// NaN for an infinite scale)
MTP_AVX512_TARGET inline __m512 int8x16_avx512(const int8_t* p, __mmask16 m, __m512 sv) {
  return _mm512_maskz_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p))), sv);
}

template <int MR, int NR>
MTP_AVX512_TARGET inline void int8_tile_avx512(const float* const* x, const int8_t* w, const float* s, int64_t k,
                                               float* out) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  auto step = [&](int64_t i, __mmask16 m, auto masked) MTP_AVX512_TARGET {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) {
      const __m512 sv = _mm512_set1_ps(s[j]);
      if constexpr (masked) {
        wv[j] = int8x16_avx512(w + j * k + i, m, sv);
      } else {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i));
        wv[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), sv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = masked ? _mm512_maskz_loadu_ps(m, x[r] + i) : _mm512_loadu_ps(x[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if (i % 64 == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kFp8Prefetch), _MM_HINT_T0);
    step(i, 0, std::false_type{});
  }
  if (i < k) step(i, Avx512::tail(k - i), std::true_type{});
  for (int r = 0; r < MR; ++r) {
    float sums[4];
    static_assert(NR == 1 || NR == 4, "reduce4 takes 4 accumulators");
    const __m512 z = _mm512_setzero_ps();
    if constexpr (NR == 4) Avx512::reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
    else Avx512::reduce4(acc[r][0], z, z, z, sums);
    for (int q = 0; q < NR; ++q) out[r * NR + q] = sums[q];
  }
}

// common.h's Tile interface: one scale per weight row (quant_rows passes s + o), no NaN weights
struct Int8Tile {
  static constexpr bool kRowScales = true;
  static MTP_INLINE bool has_nan(const int8_t*, int64_t) { return false; }
};
struct Int8GenericTile : Int8Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
    int8_tile_generic<MR, NR>(x, w, s, k, out);
  }
};
struct Int8Avx2Tile : Int8Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
    int8_tile_avx2<MR, NR>(x, w, s, k, out);
  }
};
struct Int8Avx512Tile : Int8Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
    int8_tile_avx512<MR, NR>(x, w, s, k, out);
  }
};

// Weight rows [n0, n1) against the M (< kTiledRows) activation rows
template <class Tile, int MR, int NR>
MTP_INLINE void rows_with(const Gemv& g, int64_t n0, int64_t n1) {
  const float* xs[kTiledRows];
  float* ys[kTiledRows];
  for (int64_t r = 0; r < g.m; ++r) {
    xs[r] = g.x + r * g.k;
    ys[r] = g.y + r * g.n + n0;
  }
  quant_rows<Tile, MR, NR>(g.m, xs, g.w + n0 * g.k, g.s + n0, n1 - n0, g.k, ys);
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}

void rows_generic(const Gemv& g, int64_t n0, int64_t n1) { rows_with<Int8GenericTile, 4, 1>(g, n0, n1); }

MTP_AVX2_TARGET __attribute__((flatten)) void rows_avx2(const Gemv& g, int64_t n0, int64_t n1) {
  // 16 ymm registers: accumulators MR x NR (8) + the two converted halves of one weight chunk + one x (linear_fp8's)
  if (g.m <= 2) rows_with<Int8Avx2Tile, 2, 4>(g, n0, n1);
  else rows_with<Int8Avx2Tile, 4, 2>(g, n0, n1);
}

MTP_AVX512_TARGET __attribute__((flatten)) void rows_avx512(const Gemv& g, int64_t n0, int64_t n1) {
  rows_with<Int8Avx512Tile, 4, 4>(g, n0, n1);  // 32 zmm registers: 16 accumulators + 4 weights + one x
}

void rows(Isa isa, const Gemv& g, int64_t n0, int64_t n1) {
  switch (isa) {
    case Isa::avx512: rows_avx512(g, n0, n1); break;
    case Isa::avx2: rows_avx2(g, n0, n1); break;
    default: rows_generic(g, n0, n1); break;
  }
}

// ---- dequantize rows [n0, n1) of W into dst (row-major, k wide): the fp32 values the reference computes --------
void dequant_generic(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = g.w + n * g.k;
    float* d = dst + (n - n0) * g.k;
    for (int64_t i = 0; i < g.k; ++i) d[i] = static_cast<float>(w[i]) * g.s[n];
  }
}

MTP_AVX512_TARGET __attribute__((flatten)) void dequant_avx512(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = g.w + n * g.k;
    float* d = dst + (n - n0) * g.k;
    const __m512 sv = _mm512_set1_ps(g.s[n]);
    for (int64_t i = 0; i < g.k; i += 16) {
      const __mmask16 m = g.k - i >= 16 ? static_cast<__mmask16>(0xffff) : Avx512::tail(g.k - i);
      _mm512_mask_storeu_ps(d + i, m, int8x16_avx512(w + i, m, sv));
    }
  }
}

MTP_AVX2_TARGET __attribute__((flatten)) void dequant_avx2(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = g.w + n * g.k;
    float* d = dst + (n - n0) * g.k;
    const float s = g.s[n];
    const __m256 sv = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= g.k; i += 8)
      _mm256_storeu_ps(d + i, _mm256_mul_ps(int8x8_avx2(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i))), sv));
    for (; i < g.k; ++i) d[i] = static_cast<float>(w[i]) * s;
  }
}

void dequant(Isa isa, const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  switch (isa) {
    case Isa::avx512: dequant_avx512(g, n0, n1, dst); break;
    case Isa::avx2: dequant_avx2(g, n0, n1, dst); break;
    default: dequant_generic(g, n0, n1, dst); break;
  }
}

at::Tensor linear_int8_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "mtp::linear_int8";
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), op,
                    ": x, weight and scale must be CPU tensors");
  TORCH_CHECK_VALUE(x.scalar_type() == c10::ScalarType::Float, op, ": x must be fp32, got ", x.scalar_type(),
                    " (cast the activations with .float())");
  TORCH_CHECK_VALUE(weight.scalar_type() == c10::ScalarType::Char && weight.dim() == 2, op,
                    ": weight must be a 2-D int8 tensor [N, K], got ", weight.scalar_type(), " ", py_shape(weight));
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous [N, K] (stored row-major; call "
                    ".contiguous() once when building, not per call)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK_VALUE(scale.scalar_type() == c10::ScalarType::Float && scale.dim() == 1 && scale.size(0) == n, op,
                    ": scale must be fp32 [", n, "] (one per output row of weight ", py_shape(weight), "), got ",
                    scale.scalar_type(), " ", py_shape(scale));
  const at::Tensor sc = scale.contiguous();
  return weight_only_linear(op, x, weight, n, k, bias, [&](const at::Tensor& xc, const at::Tensor& bc, at::Tensor& y2) {
    const Isa isa = active_isa();
    const Gemv g{xc.data_ptr<float>(), weight.data_ptr<int8_t>(), sc.data_ptr<float>(),
                 bc.defined() ? bc.data_ptr<float>() : nullptr, y2.data_ptr<float>(), xc.size(0), n, k};
    if (g.m >= kTiledRows) {
      dequant_tile_mm(xc, bc.defined() ? c10::optional<at::Tensor>(bc) : c10::nullopt, y2, n, k,
                      [&](int64_t n0, int64_t n1, float* dst) { dequant(isa, g, n0, n1, dst); });
      return;
    }
    // 64 output features per task: a multiple of every NR
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { rows(isa, g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_int8", &mtp::linear_int8_cpu); }
