// mtp::linear_int4 on CPU: y = x @ dequant(W)^T + b for fp32 activations x [..., K] and a group-wise weight-only int4
// weight (plugins/reference.py quantize_int4 makes it): W packed [N, K/2] uint8, two's-complement 4-bit values, column
// 2i in the low nibble of byte i and column 2i + 1 in the high one; scale [N, K/G] fp32, one per G consecutive input
// features of a row; dequant(W)[n, k] = fp32(q[n, k]) * scale[n, k / G]. Half a byte per weight plus 4 / G bytes of
// scale (0.625 at G = 32): decode at real size reads the weight once per step, so it runs about that much faster
// than int8 where memory bandwidth bounds it. Each dequantized weight is rounded once, as linear_int4_ref rounds it,
// and the math is fp32: exact up to summation order.
//
// linear_int8.cpp's structure: few rows (M < kTiledRows: decode, verify, draft) run tiles.h's int4 driver (int4_rows)
// over the int4 tile written once over the vector traits (simd_body.inc Vector::tile_int4, the one the int4 MoE
// experts use), NR weight rows x MR activation rows in registers, every m-tile of a weight-row block back to back
// (each weight byte comes from DRAM once whatever M is); a row's result is computed by the same operations whatever
// the rest of the batch is (one accumulator per (row, output), one reduction tree), so a decode row equals the same
// row inside a verify. Many rows: dequant_mm.h (a dequantized fp32 tile, tiles.h dequant_int4_rows, times MKL). The
// weight is unpacked in registers (simd.h int4x16_nibbles); AVX-512 maps the 16 nibble values to fp32(q) * scale with
// one permute from a per-group table (16 products, each the reference's rounding) and takes the tile's even / odd
// 32-column step (kEvenOdd: a quarter of an instruction per weight), AVX2 sign-extends them (a pshufb table) and
// multiplies.
//
// Paths: AVX-512, AVX2 + FMA, portable C++ (tiles.h's portable int4 tile), chosen at run time by active_isa().
// at::parallel_for over blocks of 64 output features (grain_for: a small call stays inline). G is any even number
// dividing K (a group ends on a byte); the vector loops run per group, so K need not be a multiple of the vector
// width.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "dequant_mm.h"
#include "tiles.h"

namespace mtp {
namespace {

constexpr int64_t kTiledRows = 16;  // from this many rows on, the dequantized-tile at::mm path (as linear_int8)

struct Gemv {
  const float* x;     // [M, K] fp32, contiguous
  const uint8_t* w;   // [N, K/2] packed int4, contiguous
  const float* s;     // [N, K/G] fp32, contiguous
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N] fp32
  int64_t m, n, k, group;
  int64_t row_bytes() const { return k / 2; }
  int64_t groups() const { return k / group; }
};

// Weight rows [n0, n1) against the M (< kTiledRows) activation rows: tiles.h's int4 tiles (int4_rows over
// Vector::tile_int4, with its even / odd step on AVX-512)
template <class V>
void rows_body(const Gemv& g, int64_t n0, int64_t n1) {
  const float* xs[kTiledRows];
  float* ys[kTiledRows];
  for (int64_t r = 0; r < g.m; ++r) {
    xs[r] = g.x + r * g.k;
    ys[r] = g.y + r * g.n + n0;
  }
  int4_rows<V, /*kEvenOdd=*/true>(g.m, xs, g.w + n0 * g.row_bytes(), g.s + n0 * g.groups(), n1 - n0, g.k, g.group, ys);
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}
MTP_ISA_KERNEL(rows, rows_body)

// Dequantize rows [n0, n1) of W into dst (row-major, k wide): the fp32 values the reference computes
template <class V>
void dequant_body(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  dequant_int4_rows<V>(g.w + n0 * g.row_bytes(), g.s + n0 * g.groups(), n1 - n0, g.k, g.group, dst);
}
MTP_ISA_KERNEL(dequant, dequant_body)

at::Tensor linear_int4_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t group_size,
                           const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "mtp::linear_int4";
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), op,
                    ": x, weight and scale must be CPU tensors");
  TORCH_CHECK_VALUE(x.scalar_type() == c10::ScalarType::Float, op, ": x must be fp32, got ", x.scalar_type(),
                    " (cast the activations with .float())");
  TORCH_CHECK_VALUE(weight.scalar_type() == c10::ScalarType::Byte && weight.dim() == 2, op,
                    ": weight must be a 2-D uint8 tensor [N, K/2] (two int4 per byte; plugins/reference.py "
                    "quantize_int4), got ", weight.scalar_type(), " ", py_shape(weight));
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous [N, K/2] (stored row-major; call "
                    ".contiguous() once when building, not per call)");
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 2 == 0, op, ": group_size must be a positive even number "
                    "(a group ends on a byte), got ", group_size);
  const int64_t n = weight.size(0), k = weight.size(1) * 2;
  TORCH_CHECK_VALUE(k % group_size == 0, op, ": K = ", k, " (2 * weight.size(1)) is not a multiple of group_size ",
                    group_size, " (quantize with a group size that divides K)");
  TORCH_CHECK_VALUE(scale.scalar_type() == c10::ScalarType::Float && scale.dim() == 2 && scale.size(0) == n &&
                        scale.size(1) == k / group_size,
                    op, ": scale must be fp32 [", n, ", ", k / group_size, "] (one per ", group_size,
                    " input features of each row of weight ", py_shape(weight), "), got ", scale.scalar_type(), " ",
                    py_shape(scale));
  const at::Tensor sc = scale.contiguous();
  return weight_only_linear(op, x, weight, n, k, bias, [&](const at::Tensor& xc, const at::Tensor& bc, at::Tensor& y2) {
    const Isa isa = active_isa();
    const Gemv g{xc.data_ptr<float>(), weight.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                 bc.defined() ? bc.data_ptr<float>() : nullptr, y2.data_ptr<float>(), xc.size(0), n, k, group_size};
    if (g.m >= kTiledRows) {
      dequant_tile_mm(xc, bc.defined() ? c10::optional<at::Tensor>(bc) : c10::nullopt, y2, n, k,
                      [&](int64_t n0, int64_t n1, float* dst) { dequant_on(isa, g, n0, n1, dst); });
      return;
    }
    // 64 output features per task: a multiple of every NR
    const int64_t blocks = (n + 63) / 64;
    at::parallel_for(0, blocks, grain_for(blocks, g.m * n * k),
                     [&](int64_t b0, int64_t b1) { rows_on(isa, g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_int4", &mtp::linear_int4_cpu); }
