// What the weight-only linears (linear_bf16.cpp, linear_fp8.cpp, linear_int8.cpp, linear_int4.cpp) share on the host
// side: the frame of a call (the activation and bias checks, the output, the empty cases) and the many-rows (prefill)
// path, which is compute-bound, so blocks of weight rows are converted into one reused fp32 tile (in parallel) and
// multiplied by at::mm / at::addmm (MKL). The tile holds the fp32 values the references compute (each weight rounded
// once), so that path differs from theirs only in MKL's summation order.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace mtp {

// y [M, N] = x [M, K] @ W^T (+ bias) where dequant(n0, n1, dst) writes rows [n0, n1) of W as fp32 into dst
// (row-major, k wide); x, bias and y contiguous fp32.
template <class Dequant>
void dequant_tile_mm(const at::Tensor& x, const c10::optional<at::Tensor>& bias, at::Tensor& y, int64_t n, int64_t k,
                     const Dequant& dequant) {
  // about 1 MiB of fp32 tile, a multiple of 16 rows (MKL's blocking works on it from L2, warm from the dequant)
  const int64_t rows = std::min<int64_t>(n, std::max<int64_t>(64, ((1 << 18) / std::max<int64_t>(k, 1)) / 16 * 16));
  at::Tensor tile = at::empty({rows, k}, x.options());
  float* t = tile.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n; n0 += rows) {
    const int64_t nb = std::min(rows, n - n0);
    at::parallel_for(0, nb, 16, [&](int64_t r0, int64_t r1) { dequant(n0 + r0, n0 + r1, t + r0 * k); });
    const at::Tensor wt = tile.narrow(0, 0, nb).t();
    const at::Tensor part = bias ? at::addmm(bias->narrow(0, n0, nb), x, wt) : at::mm(x, wt);
    y.narrow(1, n0, nb).copy_(part);
  }
}

// y [..., N] = x [..., K] @ W^T (+ bias) for a weight W [N, K] the caller has checked: checks x's width and the
// bias, allocates y, answers the empty cases (no output; K = 0: the bias or 0), then runs compute(xc, bc, y2) with
// the activations as a contiguous [M, K] matrix (a copy only when x is a strided view), the contiguous bias or an
// undefined tensor, and y's [M, N] view.
template <class Compute>
at::Tensor weight_only_linear(const char* op, const at::Tensor& x, const at::Tensor& weight, int64_t n, int64_t k,
                              const c10::optional<at::Tensor>& bias, const Compute& compute) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, op, ": x must be [..., ", k, "] for weight ", py_shape(weight),
                    ", got ", py_shape(x));
  if (bias) {
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == c10::ScalarType::Float && bias->dim() == 1 &&
                          bias->size(0) == n,
                      op, ": bias must be an fp32 CPU tensor [", n, "], got ", bias->scalar_type(), " ",
                      py_shape(*bias));
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (y.numel() == 0) return y;
  if (k == 0) {  // an empty sum: the bias (or 0)
    y.zero_();
    return bias ? y.add_(*bias) : y;
  }
  const at::Tensor xc = x.contiguous().view({-1, k});
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y2 = y.view({-1, n});
  compute(xc, bc, y2);
  return y;
}

}  // namespace mtp
