// mtp::linear_bf16 on CPU: y = x @ W^T + b for fp32 activations x [..., K] and a bf16 weight W [N, K]
// (nn.Linear's layout, row-major), reading the weight as bf16 and doing fp32 math in registers. bf16 -> fp32 is
// a 16-bit shift, so this is exactly the fp32 linear of the upcast weight up to summation order; the compiled
// engine's bf16-stored weights (builder/compile_aoti.py) call it instead of upcasting every weight per step.
//
// Few rows (M < kTiledRows: decode, verify, draft): each weight row is a dot product with every activation row.
// A tile of NR weight rows x MR activation rows keeps MR * NR fp32 accumulators in registers; all m-tiles of one
// weight-row block run back to back, so the block (NR * K * 2 bytes, L1-sized) comes from DRAM once and is
// re-read from L1 by the next m-tile: the weight is streamed once whatever M is. Each (row, output) dot runs the
// same lane-wise FMAs and the same horizontal sum whatever MR / NR is, so a row's result does not depend on the
// rest of the batch below kTiledRows. The [N, K] layout: one sequential stream per weight row, no panel to pack
// (a packed [K, N] panel layout was not measured; docs/PERFORMANCE.md "Compiled engine" has what was).
// Many rows (prefill chunks): compute-bound; a block of weight rows is converted into a reused fp32 tile and
// multiplied by at::mm / at::addmm (MKL), so the cost is MKL's plus one conversion of each weight per call.
// With AMX-BF16 (amx_bf16.h: checked at run time, on the AVX-512 ISA) from amx_min_rows() rows on (16, measured:
// batch 8's verify, prefill), the exact three-part AMX multiply instead of MKL: fp32 math up to accumulation order
// there too.
//
// Paths: tiles.h's bodies over bf16 rows (Bf16Weights), instantiated for AVX-512 (16 lanes), AVX2 + FMA (8 lanes;
// AMD Zen 2/3 has no AVX-512) and portable C++ by MTP_ISA_KERNEL, chosen at run time by active_isa(). No vdpbf16ps:
// it would round the activations to bf16.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "amx_bf16.h"
#include "common.h"
#include "dequant_mm.h"
#include "tiles.h"

namespace mtp {
namespace {

constexpr int64_t kTiledRows = 16;  // from this many rows on, the converted-tile at::mm path (compute-bound)

struct Gemv {
  const float* x;             // [M, K] fp32, contiguous
  const c10::BFloat16* w;     // [N, K] bf16, contiguous
  const float* bias;          // [N] or nullptr
  float* y;                   // [M, N] fp32
  int64_t m, n, k;
};

// Weight rows [n0, n1) against the M (< kTiledRows) activation rows: tiles.h's tiles over bf16 rows
template <class V>
void rows_body(const Gemv& g, int64_t n0, int64_t n1) {
  const float* xs[kTiledRows];
  float* ys[kTiledRows];
  for (int64_t r = 0; r < g.m; ++r) {
    xs[r] = g.x + r * g.k;
    ys[r] = g.y + r * g.n + n0;
  }
  tiled_rows<V, Bf16Weights>(g.m, xs, g.w + n0 * g.k, nullptr, n1 - n0, g.k, ys);
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}
MTP_ISA_KERNEL(rows, rows_body)

// bf16 rows -> fp32 (exact), for the tiled path's weight tile
template <class V>
void widen_body(const c10::BFloat16* src, float* dst, int64_t n) { V::to_f32(src, dst, n); }
MTP_ISA_KERNEL(widen, widen_body)

at::Tensor linear_bf16_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "mtp::linear_bf16";
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), op, ": x and weight must be CPU tensors");
  TORCH_CHECK_VALUE(x.scalar_type() == c10::ScalarType::Float, op, ": x must be fp32, got ", x.scalar_type(),
                    " (cast the activations with .float())");
  TORCH_CHECK_VALUE(weight.scalar_type() == c10::ScalarType::BFloat16 && weight.dim() == 2, op,
                    ": weight must be a 2-D bf16 tensor [N, K], got ", weight.scalar_type(), " ", py_shape(weight),
                    " (F.linear serves other weights)");
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous [N, K] (stored row-major; call "
                    ".contiguous() once when building, not per call)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
  return weight_only_linear(op, x, weight, n, k, bias, [&](const at::Tensor& xc, const at::Tensor& bc, at::Tensor& y2) {
    if (amx_rows(xc.size(0))) {
      amx_linear(xc.data_ptr<float>(), xc.size(0), k, w, n, bc.defined() ? bc.data_ptr<float>() : nullptr,
                 y2.data_ptr<float>(), n);
      return;
    }
    if (xc.size(0) >= kTiledRows) {
      dequant_tile_mm(xc, bc.defined() ? c10::optional<at::Tensor>(bc) : c10::nullopt, y2, n, k,
                      [&](int64_t n0, int64_t n1, float* dst) { widen(w + n0 * k, dst, (n1 - n0) * k); });
      return;
    }
    const Gemv g{xc.data_ptr<float>(), w, bc.defined() ? bc.data_ptr<float>() : nullptr, y2.data_ptr<float>(),
                 xc.size(0), n, k};
    // 64 output features per task: a multiple of every NR; one thread runs them all inline
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { rows(g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_bf16", &mtp::linear_bf16_cpu); }
