// mtp::linear_int8 on CPU: y = x @ dequant(W)^T + b for fp32 activations x [..., K] and a weight-only int8 weight
// with symmetric per-output-channel scales (what `mtp-build --quantize int8` stores; plugins/reference.py
// quantize_int8 makes it): W [N, K] int8, scale [N] fp32, dequant(W)[n, k] = fp32(W[n, k]) * scale[n]. The weight is
// read as its bytes (1 per weight) and converted in registers (sign-extend, int -> fp32, times the row's scale); every
// dequantized weight is rounded once, as plugins/reference.py linear_int8_ref rounds it, and the math is fp32: exact
// up to summation order. (Factoring the scale out of the dot product would save one multiply per weight but round
// differently from the reference and from the tiled path, whose fp32 tile must hold the dequantized values.)
//
// linear_fp8.cpp's structure: few rows (M < kTiledRows: decode, verify, draft) run common.h's quant_rows driver
// over common.h's int8 tiles (moe_experts_int8 reads its experts with the same ones), NR weight rows x MR activation
// rows in registers, every m-tile of a weight-row block back to back (each weight byte comes from DRAM once whatever M
// is); a row's result is computed by the same operations whatever the rest of the batch is (one accumulator per (row,
// output), one reduction tree), so a decode row equals the same row inside a verify. Many rows: dequant_mm.h (a
// dequantized fp32 tile times MKL).
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
