// The many-rows (prefill) path of the weight-only quantized linears, linear_fp8.cpp and linear_int8.cpp: compute-bound,
// so blocks of weight rows are dequantized into one reused fp32 tile (in parallel) and multiplied by at::mm /
// at::addmm (MKL). The tile holds the fp32 values the references compute (each weight rounded once), so this path
// differs from theirs only in MKL's summation order.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace mtp
