// mtp::mla_paged_attention on CPU: absorbed MLA attention over an MLA pool plane (kv_kind 1). The one latent
// row per position is the key of all H heads and its c_kv part (latent[rope_dim:]) the value, so the H heads
// form one query group over one "KV head" (attention.h). Returns [T, H, latent_dim - rope_dim]
// (plugins/reference.py mla_paged_attention_ref).
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include "attention.h"

namespace mtp {
namespace {

at::Tensor mla_paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_counts, const at::Tensor& kv_lens,
                                   const at::Tensor& block_tables, const at::Tensor& pool_ptr, const at::Tensor& after,
                                   int64_t plane, int64_t num_planes, int64_t num_blocks, int64_t block_size,
                                   int64_t latent_dim, int64_t dtype, int64_t rope_dim, double scale) {
  constexpr const char* op = "mla_paged_attention";
  check_float(q, op, "q");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == latent_dim, op, ": q must be [T, H, ", latent_dim, "], got ",
                    py_shape(q));
  TORCH_CHECK_VALUE(0 <= rope_dim && rope_dim < latent_dim, op, ": rope_dim ", rope_dim,
                    " must be in [0, latent_dim ", latent_dim, ")");
  TORCH_CHECK_VALUE(block_tables.dim() == 2, op, ": block_tables must be [R, max_blocks]");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, 1, latent_dim, dtype, 1, op);
  const Ints qc = ints(q_counts, op, "q_counts"), kl = ints(kv_lens, op, "kv_lens");
  const Ints t = ints(block_tables, op, "block_tables");
  const int64_t num_requests = q_counts.numel();
  TORCH_CHECK_VALUE(kv_lens.numel() == num_requests && block_tables.size(0) == num_requests, op,
                    ": q_counts, kv_lens and block_tables must have one entry per request");
  const at::Tensor qq = q.contiguous();
  const int64_t heads = q.size(1), value_dim = latent_dim - rope_dim;
  at::Tensor out = at::empty({q.size(0), heads, value_dim}, q.options());
  const AttendArgs args{qq.data_ptr(), out.data_ptr(), q.size(0), &qc, &kl, &t, num_requests, block_tables.size(1),
                        1, heads, latent_dim, value_dim, 0, rope_dim, static_cast<float>(scale), &pool, op};
  attend_pool(args, q.scalar_type(), pool.dtype);
  return out;
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("mla_paged_attention", &mtp::mla_paged_attention_cpu); }
