// mtp::linear_int8 on CPU: y = x @ dequant(W)^T + b for fp32 activations x [..., K] and a weight-only int8 weight
// with symmetric per-output-channel scales (what `mtp-build --quantize int8` stores; plugins/reference.py
// quantize_int8 makes it): W [N, K] int8, scale [N] fp32, dequant(W)[n, k] = fp32(W[n, k]) * scale[n]. The weight is
// read as its bytes (1 per weight) and converted in registers (sign-extend, int -> fp32, times the row's scale); every
// dequantized weight is rounded once, as plugins/reference.py linear_int8_ref rounds it, and the math is fp32: exact
// up to summation order. (Factoring the scale out of the dot product would save one multiply per weight but round
// differently from the reference and from the tiled path, whose fp32 tile must hold the dequantized values.)
//
// linear_fp8.cpp's structure: few rows (M < kTiledRows: decode, verify, draft) run tiles.h's quant_rows driver
// over its int8 tiles (moe_experts_int8 reads its experts with the same ones), NR weight rows x MR activation
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
#include "tiles.h"

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

// Weight rows [n0, n1) against the M (< kTiledRows) activation rows: tiles.h's tiles over int8 rows
template <class V>
void rows_body(const Gemv& g, int64_t n0, int64_t n1) {
  const float* xs[kTiledRows];
  float* ys[kTiledRows];
  for (int64_t r = 0; r < g.m; ++r) {
    xs[r] = g.x + r * g.k;
    ys[r] = g.y + r * g.n + n0;
  }
  tiled_rows<V, Int8Weights>(g.m, xs, g.w + n0 * g.k, g.s + n0, n1 - n0, g.k, ys);
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}
MTP_ISA_KERNEL(rows, rows_body)

// Dequantize rows [n0, n1) of W into dst (row-major, k wide): the fp32 values the reference computes
template <class V>
void dequant_body(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  dequant_rows<V, Int8Weights>(g.w + n0 * g.k, g.s + n0, n1 - n0, g.k, dst);
}
MTP_ISA_KERNEL(dequant, dequant_body)

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
                      [&](int64_t n0, int64_t n1, float* dst) { dequant_on(isa, g, n0, n1, dst); });
      return;
    }
    // 64 output features per task: a multiple of every NR
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { rows_on(isa, g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_int8", &mtp::linear_int8_cpu); }
