// mtp::linear_fp8 on CPU: y = x @ dequant(W)^T + b for fp32 activations x [..., K] and a block-quantized FP8
// weight as the FP8 releases ship it (DeepSeek-V3/R1, GLM-4.5-FP8): W [N, K] float8_e4m3fn (or its uint8 bits),
// scale_inv [ceil(N/128), ceil(K/128)] fp32, dequant(W)[n, k] = fp32(W[n, k]) * scale_inv[n / 128, k / 128]. The
// weight is read as its bytes (1 per weight) and converted in registers; every dequantized weight is rounded once,
// as plugins/reference.py linear_fp8_ref rounds it, and the math is fp32: exact up to summation order.
//
// Few rows (M < kTiledRows: decode, verify, draft): linear_bf16's dot-product kernel over the weight's rows, a
// tile of NR weight rows x MR activation rows in registers, every m-tile of a weight-row block back to back (each
// weight byte comes from DRAM once whatever M is), the scale block changing every 128 columns. A row's result is
// computed by the same operations whatever the rest of the batch is (lane i % width of one accumulator per
// (row, output), one reduction tree), so a decode row equals the same row inside a verify.
// Many rows (prefill chunks): dequant_mm.h, a block of weight rows dequantized into a reused fp32 tile (the same
// fp32 values) and multiplied by at::mm / at::addmm (MKL).
//
// Paths: AVX-512, AVX2 + FMA + F16C (the e4m3 -> fp16 -> fp32 conversion of common.h), portable C++ (a 256-entry
// table), chosen at run time by active_isa(); a scale too large for the vector conversion's exact rescaling
// (|s| >= 2^120, never in a release) sends the call to the portable path. at::parallel_for over blocks of 64
// output features.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "dequant_mm.h"

namespace mtp {
namespace {

constexpr int64_t kTiledRows = 16;  // from this many rows on, the dequantized-tile at::mm path (compute-bound)
constexpr int64_t kBlock = kFp8Block;

struct Gemv {
  const float* x;      // [M, K] fp32, contiguous
  const uint8_t* w;    // [N, K] e4m3 bytes, contiguous
  const float* s;      // [ceil(N/128), kb] fp32 scale_inv, contiguous
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N] fp32
  int64_t m, n, k, kb;
};

MTP_INLINE float deq(uint8_t q, float s) { return e4m3_times(q, s); }

// Weight rows [n0, n1), inside one 128-row scale block, against the M (< kTiledRows) activation rows: common.h's
// FP8 tiles (NR weight rows x MR activation rows in registers, every m-tile of a weight-row block back to back).
template <class Tile, int MR, int NR>
MTP_INLINE void rows_with(const Gemv& g, int64_t n0, int64_t n1) {
  const float* xs[kTiledRows];
  float* ys[kTiledRows];
  for (int64_t r = 0; r < g.m; ++r) {
    xs[r] = g.x + r * g.k;
    ys[r] = g.y + r * g.n + n0;
  }
  quant_rows<Tile, MR, NR>(g.m, xs, g.w + n0 * g.k, g.s + (n0 / kBlock) * g.kb, n1 - n0, g.k, ys);
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}

void rows_generic(const Gemv& g, int64_t n0, int64_t n1) { rows_with<Fp8GenericTile, 4, 1>(g, n0, n1); }

MTP_AVX2_TARGET __attribute__((flatten)) void rows_avx2(const Gemv& g, int64_t n0, int64_t n1) {
  // 16 ymm registers: accumulators MR x NR (8) + the two halves of one converted weight chunk + one x
  if (g.m <= 2) rows_with<Fp8Avx2Tile, 2, 4>(g, n0, n1);
  else rows_with<Fp8Avx2Tile, 4, 2>(g, n0, n1);
}

MTP_AVX512_TARGET __attribute__((flatten)) void rows_avx512(const Gemv& g, int64_t n0, int64_t n1) {
  rows_with<Fp8Avx512Tile, 4, 4>(g, n0, n1);  // 32 zmm registers: 16 accumulators + 4 weights + one x
}

// ---- dequantize rows [n0, n1) of W into dst (row-major, k wide): the fp32 values the reference computes --------
void dequant_generic(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = g.w + n * g.k;
    const float* srow = g.s + (n / kBlock) * g.kb;
    float* d = dst + (n - n0) * g.k;
    for (int64_t i = 0; i < g.k; ++i) d[i] = deq(w[i], srow[i / kBlock]);
  }
}

MTP_AVX512_TARGET __attribute__((flatten)) void dequant_avx512(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = g.w + n * g.k;
    const float* srow = g.s + (n / kBlock) * g.kb;
    float* d = dst + (n - n0) * g.k;
    for (int64_t c0 = 0; c0 < g.k; c0 += kBlock) {
      const __m512 sv = _mm512_set1_ps(srow[c0 / kBlock] * 256.0f);
      const int64_t end = std::min(g.k, c0 + kBlock);
      for (int64_t i = c0; i < end; i += 16) {
        const __mmask16 m = end - i >= 16 ? static_cast<__mmask16>(0xffff) : Avx512::tail(end - i);
        _mm512_mask_storeu_ps(d + i, m, _mm512_mul_ps(e4m3x16_nan_avx512(w + i, m), sv));
      }
    }
  }
}

MTP_AVX2_TARGET __attribute__((flatten)) void dequant_avx2(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = g.w + n * g.k;
    const float* srow = g.s + (n / kBlock) * g.kb;
    float* d = dst + (n - n0) * g.k;
    for (int64_t c0 = 0; c0 < g.k; c0 += kBlock) {
      const float s = srow[c0 / kBlock];
      const __m256 sv = _mm256_set1_ps(s * 256.0f);
      const int64_t end = std::min(g.k, c0 + kBlock);
      int64_t i = c0;
      for (; i + 8 <= end; i += 8) _mm256_storeu_ps(d + i, _mm256_mul_ps(e4m3x8_avx2<true>(w + i), sv));
      for (; i < end; ++i) d[i] = deq(w[i], s);
    }
  }
}

// Weight rows [n0, n1), one 128-row scale block at a time
void rows(Isa isa, const Gemv& g, int64_t n0, int64_t n1) {
  for (int64_t a = n0, b; a < n1; a = b) {
    b = std::min(n1, (a / kBlock + 1) * kBlock);
    switch (isa) {
      case Isa::avx512: rows_avx512(g, a, b); break;
      case Isa::avx2: rows_avx2(g, a, b); break;
      default: rows_generic(g, a, b); break;
    }
  }
}

void dequant(Isa isa, const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  switch (isa) {
    case Isa::avx512: dequant_avx512(g, n0, n1, dst); break;
    case Isa::avx2: dequant_avx2(g, n0, n1, dst); break;
    default: dequant_generic(g, n0, n1, dst); break;
  }
}

at::Tensor linear_fp8_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale_inv,
                          const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "mtp::linear_fp8";
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu() && scale_inv.device().is_cpu(), op,
                    ": x, weight and scale_inv must be CPU tensors");
  TORCH_CHECK_VALUE(x.scalar_type() == c10::ScalarType::Float, op, ": x must be fp32, got ", x.scalar_type(),
                    " (cast the activations with .float())");
  const auto wt = weight.scalar_type();
  TORCH_CHECK_VALUE((wt == c10::ScalarType::Float8_e4m3fn || wt == c10::ScalarType::Byte) && weight.dim() == 2, op,
                    ": weight must be a 2-D float8_e4m3fn tensor [N, K] (or its uint8 bits), got ", wt, " ",
                    py_shape(weight));
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous [N, K] (stored row-major; call "
                    ".contiguous() once when building, not per call)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t nb = (n + kBlock - 1) / kBlock, kb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK_VALUE(scale_inv.scalar_type() == c10::ScalarType::Float && scale_inv.dim() == 2 &&
                        scale_inv.size(0) == nb && scale_inv.size(1) == kb,
                    op, ": scale_inv must be fp32 [", nb, ", ", kb, "] (one per 128 x 128 block of weight ",
                    py_shape(weight), "), got ", scale_inv.scalar_type(), " ", py_shape(scale_inv));
  const at::Tensor sc = scale_inv.contiguous();
  return weight_only_linear(op, x, weight, n, k, bias, [&](const at::Tensor& xc, const at::Tensor& bc, at::Tensor& y2) {
    const float* s = sc.data_ptr<float>();
    const Isa isa = fp8_scales_vector_safe(s, sc.numel()) ? active_isa() : Isa::generic;
    const Gemv g{xc.data_ptr<float>(), static_cast<const uint8_t*>(weight.data_ptr()), s,
                 bc.defined() ? bc.data_ptr<float>() : nullptr, y2.data_ptr<float>(), xc.size(0), n, k, kb};
    if (g.m >= kTiledRows) {
      dequant_tile_mm(xc, bc.defined() ? c10::optional<at::Tensor>(bc) : c10::nullopt, y2, n, k,
                      [&](int64_t n0, int64_t n1, float* dst) { dequant(isa, g, n0, n1, dst); });
      return;
    }
    // 64 output features per task: a multiple of every NR, dividing the 128-row scale blocks
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { rows(isa, g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_fp8", &mtp::linear_fp8_cpu); }
