// mtp::swa_paged_attention on CPU: paged_attention.cpp's GQA attention in its sliding-window mode, with per-head
// attention sinks (MiMo-V2-Flash's SWA layers; plugins/reference_swa.py swa_paged_attention_ref). The loops are
// attention.h's (AttendArgs.window, AttendArgs.sinks); window 0 is causal attention over every key.
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include "attention.h"

namespace mtp {
namespace {

at::Tensor swa_paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_counts, const at::Tensor& kv_lens,
                                   const at::Tensor& block_tables, const at::Tensor& pool_ptr, const at::Tensor& after,
                                   const at::Tensor& sinks, int64_t plane, int64_t num_planes, int64_t num_blocks,
                                   int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t dtype,
                                   double scale, int64_t window) {
  constexpr const char* op = "swa_paged_attention";
  check_float(q, op, "q");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == head_dim && q.size(1) % num_kv_heads == 0, op,
                    ": q must be [T, Hq, ", head_dim, "] with Hq a multiple of num_kv_heads ", num_kv_heads, ", got ",
                    q.sizes());
  TORCH_CHECK_VALUE(sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == q.size(1), op,
                    ": sinks must be float32 [Hq=", q.size(1), "] (one sink logit per query head), got ",
                    sinks.scalar_type(), " ", sinks.sizes());
  TORCH_CHECK_VALUE(window >= 0, op, ": window must be >= 0 (0 = no window), got ", window);
  TORCH_CHECK_VALUE(block_tables.dim() == 2, op, ": block_tables must be [R, max_blocks]");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                    2, op);
  const Ints qc = ints(q_counts, op, "q_counts"), kl = ints(kv_lens, op, "kv_lens");
  const Ints t = ints(block_tables, op, "block_tables");
  const int64_t num_requests = q_counts.numel();
  TORCH_CHECK_VALUE(kv_lens.numel() == num_requests && block_tables.size(0) == num_requests, op,
                    ": q_counts, kv_lens and block_tables must have one entry per request");
  const at::Tensor qq = q.contiguous(), ss = sinks.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const AttendArgs args{qq.data_ptr(), out.data_ptr(), q.size(0), &qc, &kl, &t, num_requests, block_tables.size(1),
                        num_kv_heads, q.size(1) / num_kv_heads, head_dim, head_dim, 1, 0, static_cast<float>(scale),
                        &pool, op, window, ss.data_ptr<float>()};
  attend_pool(args, q.scalar_type(), pool.dtype);
  return out;
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("swa_paged_attention", &mtp::swa_paged_attention_cpu); }
