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
// Paths: tiles.h's bodies over e4m3 rows (Fp8Weights) for AVX-512, AVX2 + FMA + F16C (simd.h's e4m3 -> fp16 -> fp32
// conversion) and portable C++ (a 256-entry table), chosen at run time by active_isa() (MTP_ISA_KERNEL); a scale too large for the vector conversion's exact rescaling
// (|s| >= 2^120, never in a release) sends the call to the portable path. at::parallel_for over blocks of 64
// output features.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "dequant_mm.h"
#include "tiles.h"

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

// Weight rows [n0, n1) against the M (< kTiledRows) activation rows, one 128-row scale block at a time: tiles.h's
// tiles over e4m3 rows (NR weight rows x MR activation rows in registers, every m-tile of a weight-row block back to
// back).
template <class V>
void rows_body(const Gemv& g, int64_t n0, int64_t n1) {
  const float* xs[kTiledRows];
  float* ys[kTiledRows];
  for (int64_t a = n0, b; a < n1; a = b) {
    b = std::min(n1, (a / kBlock + 1) * kBlock);
    for (int64_t r = 0; r < g.m; ++r) {
      xs[r] = g.x + r * g.k;
      ys[r] = g.y + r * g.n + a;
    }
    tiled_rows<V, Fp8Weights>(g.m, xs, g.w + a * g.k, g.s + (a / kBlock) * g.kb, b - a, g.k, ys);
  }
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}
MTP_ISA_KERNEL(rows, rows_body)

// Dequantize rows [n0, n1) of W into dst (row-major, k wide): the fp32 values the reference computes
template <class V>
void dequant_body(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t a = n0, b; a < n1; a = b) {
    b = std::min(n1, (a / kBlock + 1) * kBlock);
    dequant_rows<V, Fp8Weights>(g.w + a * g.k, g.s + (a / kBlock) * g.kb, b - a, g.k, dst + (a - n0) * g.k);
  }
}
MTP_ISA_KERNEL(dequant, dequant_body)

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
                      [&](int64_t n0, int64_t n1, float* dst) { dequant_on(isa, g, n0, n1, dst); });
      return;
    }
    // 64 output features per task: a multiple of every NR, dividing the 128-row scale blocks
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { rows_on(isa, g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_fp8", &mtp::linear_fp8_cpu); }
