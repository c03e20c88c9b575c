// mtp::paged_attention on CPU: causal GQA attention of packed queries over one pool plane's paged K/V
// (plugins/reference.py paged_attention_ref); the loops are in attention.h, shared with MLA.
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include "attention.h"

namespace mtp {
namespace {

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_counts, const at::Tensor& kv_lens,
                               const at::Tensor& block_tables, const at::Tensor& pool_ptr, const at::Tensor& after,
                               int64_t plane, int64_t num_planes, int64_t num_blocks, int64_t block_size,
                               int64_t num_kv_heads, int64_t head_dim, int64_t dtype, double scale) {
  constexpr const char* op = "paged_attention";
  check_float(q, op, "q");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == head_dim && q.size(1) % num_kv_heads == 0, op,
                    ": q must be [T, Hq, ", head_dim, "] with Hq a multiple of num_kv_heads ", num_kv_heads, ", got ",
                    q.sizes());
  TORCH_CHECK_VALUE(block_tables.dim() == 2, op, ": block_tables must be [R, max_blocks]");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                    2, op);
  const Ints qc = ints(q_counts, op, "q_counts"), kl = ints(kv_lens, op, "kv_lens");
  const Ints t = ints(block_tables, op, "block_tables");
  const int64_t num_requests = q_counts.numel();
  TORCH_CHECK_VALUE(kv_lens.numel() == num_requests && block_tables.size(0) == num_requests, op,
                    ": q_counts, kv_lens and block_tables must have one entry per request");
  const at::Tensor qq = q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const AttendArgs args{qq.data_ptr(), out.data_ptr(), q.size(0), &qc, &kl, &t, num_requests, block_tables.size(1),
                        num_kv_heads, q.size(1) / num_kv_heads, head_dim, head_dim, 1, 0, static_cast<float>(scale),
                        &pool, op};
  attend_pool(args, q.scalar_type(), pool.dtype);
  return out;
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("paged_attention", &mtp::paged_attention_cpu); }
