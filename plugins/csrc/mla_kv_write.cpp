// mtp::mla_kv_write on CPU: one latent row [k_pe ; c_kv] per position into an MLA pool (kv_kind 1), k_pe roped
// at its write position with the given inv_freq and YaRN scale when rope_dim > 0. Same segments, padding and
// no-op rules as kv_write (plugins/reference.py mla_kv_write_ref).
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"

namespace mtp {
namespace {

constexpr const char* kOp = "mla_kv_write";

struct LatentArgs {
  const void* latent;  // [T, L]
  const Ints* counts;
  const Ints* starts;
  const Ints* tables;
  int64_t num_requests, cols, latent_dim, rope_dim;
  const PoolPlane* pool;
  const float* inv_freq;  // [rope_dim / 2]
  float rope_scale;
};

// The rows rs[i0 .. i1) (row_slots), on the calling thread with its own scratch (an ISA kernel of its own, as
// kv_write's write_rows).
template <class V, class In, class P>
void write_latents(const LatentArgs& a, const RowSlot* rs, int64_t i0, int64_t i1) {
  const In* src = static_cast<const In*>(a.latent);
  const int64_t half = a.rope_dim / 2;
  float* buf = scratch(0, a.latent_dim + 2 * half);
  float* c = buf + a.latent_dim;
  float* s = c + half;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t pos = rs[i].pos;
    P* dst = reinterpret_cast<P*>(a.pool->row(0, rs[i].block, pos % a.pool->block_size, 0));
    V::to_f32(src + rs[i].row * a.latent_dim, buf, a.latent_dim);
    if (half) {
      rope_cos_sin(pos, a.inv_freq, half, a.rope_scale, c, s);
      rope_rotate(buf, c, s, half);
    }
    for (int64_t d = 0; d < a.latent_dim; ++d) dst[d] = from_f32<P>(buf[d]);
  }
}

MTP_ISA_KERNEL(run_write_latents, write_latents)

// Threads: as kv_write's write_all (independent rows; a prefill splits, a decode step stays inline).
template <class In, class P>
int64_t write_all(const LatentArgs& a) {
  const std::vector<RowSlot> rs = row_slots(*a.counts, *a.starts, *a.tables, a.num_requests, a.cols,
                                            a.pool->block_size, a.pool->num_blocks, kOp);
  const int64_t n = static_cast<int64_t>(rs.size());
  const int64_t grain = write_grain(rs, a.pool->block_size, 2 * a.latent_dim + 20 * (a.rope_dim / 2));
  if (n > 0)
    at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) { run_write_latents<In, P>(a, rs.data(), i0, i1); });
  return n;
}

at::Tensor mla_kv_write_cpu(const at::Tensor& latent, const at::Tensor& counts, const at::Tensor& starts,
                            const at::Tensor& block_tables, const at::Tensor& pool_ptr, const at::Tensor& inv_freq,
                            int64_t plane, int64_t num_planes, int64_t num_blocks, int64_t block_size,
                            int64_t latent_dim, int64_t dtype, int64_t rope_dim, double rope_scale) {
  check_float(latent, kOp, "latent");
  TORCH_CHECK_VALUE(latent.dim() == 2 && latent.size(1) == latent_dim, kOp, ": latent must be [T, ", latent_dim,
                    "], got ", py_shape(latent));
  TORCH_CHECK_VALUE(rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= latent_dim, kOp, ": rope_dim ", rope_dim,
                    " must be even and within latent_dim ", latent_dim);
  TORCH_CHECK_VALUE(rope_dim == 0 || (inv_freq.dim() == 1 && inv_freq.size(0) == rope_dim / 2), kOp,
                    ": inv_freq has shape ", py_shape(inv_freq), ", rope_dim ", rope_dim, " needs [", rope_dim / 2, "]");
  TORCH_CHECK_VALUE(block_tables.dim() == 2, kOp, ": block_tables must be [R, max_blocks]");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, 1, latent_dim, dtype, 1, kOp);
  const Ints c = ints(counts, kOp, "counts"), s = ints(starts, kOp, "starts");
  const Ints t = ints(block_tables, kOp, "block_tables");
  const int64_t num_requests = counts.numel();
  TORCH_CHECK_VALUE(starts.numel() == num_requests && block_tables.size(0) == num_requests, kOp,
                    ": counts, starts and block_tables must have one entry per request");
  int64_t total = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK_VALUE(c[r] >= 0 && s[r] >= 0, kOp, ": counts and starts must be >= 0");
    total += c[r];
  }
  TORCH_CHECK_VALUE(total <= latent.size(0), kOp, ": segments hold ", total, " rows but only ", latent.size(0),
                    " latent rows were given");
  std::vector<float> freqs(static_cast<size_t>(rope_dim / 2));
  if (rope_dim) {
    check_float(inv_freq, kOp, "inv_freq");
    const at::Tensor f = inv_freq.contiguous();
    dispatch_float(f.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      for (int64_t i = 0; i < rope_dim / 2; ++i) freqs[i] = f32(f.data_ptr<T>()[i]);
    });
  }
  const at::Tensor lc = latent.contiguous();
  const LatentArgs args{lc.data_ptr(), &c, &s, &t, num_requests, block_tables.size(1), latent_dim, rope_dim, &pool,
                        freqs.data(), static_cast<float>(rope_scale)};
  return rows_written(dispatch_float2(latent.scalar_type(), pool.dtype, [&](auto in, auto out) {
    return write_all<decltype(in), decltype(out)>(args);
  }));
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("mla_kv_write", &mtp::mla_kv_write_cpu); }
