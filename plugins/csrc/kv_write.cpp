// mtp::kv_write on CPU: row j of request r goes to position starts[r]+j -> block table[r][pos / B],
// slot pos % B of `plane` (K and V), K optionally roped at that position (the MTP commit pass).
// Padding rows past sum(counts), block -1 and positions past the table store nothing; every other pool
// byte stays untouched. Semantics: plugins/reference.py kv_write_ref. No per-forward plan: the slot of a
// row is one division, cheaper than looking a plan up.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"

namespace mtp {
namespace {

constexpr const char* kOp = "kv_write";

struct WriteArgs {
  const void* k;
  const void* v;
  const Ints* counts;
  const Ints* starts;
  const Ints* tables;
  int64_t num_requests, cols, heads, head_dim, rope_dim;
  const PoolPlane* pool;
  const float* inv_freq;  // [rope_dim / 2]
};

// The rows rs[i0 .. i1) (row_slots), on the calling thread with its own scratch. An ISA kernel of its own, not a
// lambda inside one (an at::parallel_for body is not compiled for the ISA of the function containing it).
template <class V, class In, class P>
void write_rows(const WriteArgs& a, const RowSlot* rs, int64_t i0, int64_t i1) {
  const In* k = static_cast<const In*>(a.k);
  const In* v = static_cast<const In*>(a.v);
  const int64_t width = a.heads * a.head_dim, half = a.rope_dim / 2;
  float* key = scratch(0, a.head_dim + 2 * half);
  float* c = key + a.head_dim;
  float* s = c + half;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t row = rs[i].row, pos = rs[i].pos, block = rs[i].block, slot = pos % a.pool->block_size;
    if (half) rope_cos_sin(pos, a.inv_freq, half, 1.0f, c, s);
    for (int64_t h = 0; h < a.heads; ++h) {
      P* kd = reinterpret_cast<P*>(a.pool->row(0, block, slot, h));
      P* vd = reinterpret_cast<P*>(a.pool->row(1, block, slot, h));
      const In* ks = k + row * width + h * a.head_dim;
      const In* vs = v + row * width + h * a.head_dim;
      if (half) {
        V::to_f32(ks, key, a.head_dim);
        rope_rotate(key, c, s, half);
        for (int64_t d = 0; d < a.head_dim; ++d) kd[d] = from_f32<P>(key[d]);
      } else {
        for (int64_t d = 0; d < a.head_dim; ++d) kd[d] = from_f32<P>(f32(ks[d]));
      }
      for (int64_t d = 0; d < a.head_dim; ++d) vd[d] = from_f32<P>(f32(vs[d]));
    }
  }
}

MTP_ISA_KERNEL(run_write, write_rows)

// Threads: rows are independent (each writes its own pool slot; the same operations on any thread), so a prefill's
// rows split over torch's threads. A decode or verify step (a few rows, ~1-4 us) stays inline (grain_for); the
// work estimate counts a conversion per K and V value and ~20 per RoPE angle (cos + sin, libm).
template <class In, class P>
int64_t write_all(const WriteArgs& a) {
  const std::vector<RowSlot> rs = row_slots(*a.counts, *a.starts, *a.tables, a.num_requests, a.cols,
                                            a.pool->block_size, a.pool->num_blocks, kOp);
  const int64_t n = static_cast<int64_t>(rs.size());
  const int64_t grain = write_grain(rs, a.pool->block_size, 2 * a.heads * a.head_dim + 20 * (a.rope_dim / 2));
  if (n > 0) at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) { run_write<In, P>(a, rs.data(), i0, i1); });
  return n;
}

at::Tensor kv_write_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& counts, const at::Tensor& starts,
                        const at::Tensor& block_tables, const at::Tensor& pool_ptr, int64_t plane, int64_t num_planes,
                        int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t dtype,
                        int64_t rope_dim, double rope_theta) {
  check_float(k, kOp, "k");
  TORCH_CHECK_VALUE(v.scalar_type() == k.scalar_type(), "kv_write: k and v must have one dtype, got ",
                    k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK_VALUE(k.dim() == 3 && k.size(1) == num_kv_heads && k.size(2) == head_dim && v.sizes() == k.sizes(),
                    "kv_write: k and v must be [T, ", num_kv_heads, ", ", head_dim, "], got ", k.sizes(), " and ",
                    v.sizes());
  TORCH_CHECK_VALUE(rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= head_dim, "kv_write: rope_dim ", rope_dim,
                    " must be even and within head_dim ", head_dim);
  TORCH_CHECK_VALUE(block_tables.dim() == 2, "kv_write: block_tables must be [R, max_blocks]");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                    2, kOp);
  const Ints c = ints(counts, kOp, "counts"), s = ints(starts, kOp, "starts"), t = ints(block_tables, kOp, "block_tables");
  const int64_t num_requests = counts.numel();
  TORCH_CHECK_VALUE(starts.numel() == num_requests && block_tables.size(0) == num_requests,
                    "kv_write: counts, starts and block_tables must have one entry per request");
  int64_t total = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK_VALUE(c[r] >= 0 && s[r] >= 0, "kv_write: counts and starts must be >= 0");
    total += c[r];
  }
  TORCH_CHECK_VALUE(total <= k.size(0), "kv_write: segments hold ", total, " rows but only ", k.size(0),
                    " K/V rows were given");
  std::vector<float> inv_freq(static_cast<size_t>(rope_dim / 2));
  for (int64_t i = 0; i < rope_dim / 2; ++i)  // plugins/rope.py default_inv_freq, in fp32
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(rope_theta), static_cast<float>(2 * i) / static_cast<float>(rope_dim));
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const WriteArgs args{kc.data_ptr(), vc.data_ptr(), &c, &s, &t, num_requests, block_tables.size(1),
                       num_kv_heads, head_dim, rope_dim, &pool, inv_freq.data()};
  return rows_written(dispatch_float2(k.scalar_type(), pool.dtype, [&](auto in, auto out) {
    return write_all<decltype(in), decltype(out)>(args);
  }));
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("kv_write", &mtp::kv_write_cpu); }
