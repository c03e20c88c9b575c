// Causal paged attention over one pool plane, shared by paged_attention.cpp (GQA) and
// mla_paged_attention.cpp (absorbed MLA: one latent "KV head", keys = the latent, values = its c_kv part).
//
// Per request r and KV head g, the n_q * group queries of that head are attended together: each key row is
// read from the pool once (converted to fp32 once) and dotted with every query that sees it; query j sits at
// kv_lens[r] - q_counts[r] + j and sees keys 0..that. Scores, softmax and the weighted value sum are fp32,
// each query row computed alone (the same operations whatever the batch). Rows past sum(q_counts) are zeros;
// a query that sees no key (kv_len < q_count) is zeros too. Semantics: plugins/reference.py.
#pragma once

#include "common.h"

namespace mtp {

struct AttendArgs {
  const void* q;  // [T, Hq, dk]
  void* out;      // [T, Hq, dv]
  int64_t rows;   // T
  const Ints* q_counts;
  const Ints* kv_lens;
  const Ints* tables;
  int64_t num_requests, cols;
  int64_t kv_heads, group, dk, dv;
  int64_t value_kv, value_offset;  // value row = pool.row(value_kv, ...) + value_offset elements
  float scale;
  const PoolPlane* pool;
  const char* op;
};

// Validates the per-request metadata before any kernel runs (one-line ValueErrors, never a bad read).
inline void check_attend(const AttendArgs& a) {
  int64_t total = 0, max_len = 0;
  for (int64_t r = 0; r < a.num_requests; ++r) {
    const int64_t n_q = (*a.q_counts)[r], n_kv = (*a.kv_lens)[r];
    TORCH_CHECK_VALUE(n_q >= 0 && n_kv >= 0, a.op, ": q_counts and kv_lens must be >= 0");
    total += n_q;
    if (n_q == 0) continue;
    max_len = std::max(max_len, n_kv);
  }
  TORCH_CHECK_VALUE(total <= a.rows, a.op, ": q_counts sum to ", total, " rows but q has ", a.rows);
  TORCH_CHECK_VALUE(max_len == 0 || (max_len - 1) / a.pool->block_size < a.cols, a.op, ": kv_lens up to ", max_len,
                    " need more than the ", a.cols, " block-table columns given (block size ", a.pool->block_size,
                    "); pass wider block tables");
  for (int64_t r = 0; r < a.num_requests; ++r) {
    if ((*a.q_counts)[r] == 0) continue;
    const int64_t used = ((*a.kv_lens)[r] + a.pool->block_size - 1) / a.pool->block_size;
    for (int64_t c = 0; c < used; ++c)
      TORCH_CHECK_VALUE((*a.tables)[r * a.cols + c] < a.pool->num_blocks, a.op, ": block id ",
                        (*a.tables)[r * a.cols + c], " (request ", r, ") is outside the pool's ", a.pool->num_blocks,
                        " blocks");
  }
}

template <class V, class Q, class P>
void attend(const AttendArgs& a) {
  const Q* q = static_cast<const Q*>(a.q);
  Q* out = static_cast<Q*>(a.out);
  const int64_t hq = a.kv_heads * a.group, bs = a.pool->block_size;
  const int64_t q_row = hq * a.dk, out_row = hq * a.dv;
  int64_t row0 = 0;
  for (int64_t r = 0; r < a.num_requests; ++r) {
    const int64_t n_q = (*a.q_counts)[r], n_kv = (*a.kv_lens)[r];
    if (n_q == 0) continue;
    const int64_t first = n_kv - n_q;  // position of query 0
    const int64_t rows_g = n_q * a.group;
    float* qf = scratch(0, rows_g * a.dk + 2 * std::max(a.dk, a.dv) + rows_g);
    float* kbuf = qf + rows_g * a.dk;
    float* sums = kbuf + 2 * std::max(a.dk, a.dv);
    float* s = scratch(1, rows_g * std::max<int64_t>(n_kv, 1));
    float* acc = scratch(2, rows_g * a.dv);
    for (int64_t g = 0; g < a.kv_heads; ++g) {
      for (int64_t j = 0; j < n_q; ++j)
        for (int64_t h = 0; h < a.group; ++h)
          V::to_f32(q + (row0 + j) * q_row + (g * a.group + h) * a.dk, qf + (j * a.group + h) * a.dk, a.dk);
      // scores: key p is seen by queries j >= p - first
      for (int64_t p = 0; p < n_kv; ++p) {
        const int64_t j0 = std::max<int64_t>(0, p - first);
        if (j0 >= n_q) break;
        int64_t block = (*a.tables)[r * a.cols + p / bs];
        if (block < 0) block = 0;  // a hole inside kv_len reads the null block (outside the contract)
        const P* kp = reinterpret_cast<const P*>(a.pool->row(0, block, p % bs, g));
        const float* kf;
        if constexpr (std::is_same_v<P, float>) kf = kp;
        else { V::to_f32(kp, kbuf, a.dk); kf = kbuf; }
        for (int64_t jh = j0 * a.group; jh < rows_g; ++jh)
          s[jh * n_kv + p] = V::dot(qf + jh * a.dk, kf, a.dk) * a.scale;
      }
      // softmax numerators and sums
      for (int64_t jh = 0; jh < rows_g; ++jh) {
        const int64_t len = std::min(first + jh / a.group + 1, n_kv);
        if (len <= 0) { sums[jh] = 0.0f; continue; }
        float* row = s + jh * n_kv;
        float m = row[0];
        for (int64_t p = 1; p < len; ++p) m = std::max(m, row[p]);
        V::exp_sub(row, m, len);
        float sum = 0.0f;
        for (int64_t p = 0; p < len; ++p) sum += row[p];
        sums[jh] = sum;
      }
      // weighted values
      std::fill(acc, acc + rows_g * a.dv, 0.0f);
      for (int64_t p = 0; p < n_kv; ++p) {
        const int64_t j0 = std::max<int64_t>(0, p - first);
        if (j0 >= n_q) break;
        int64_t block = (*a.tables)[r * a.cols + p / bs];
        if (block < 0) block = 0;
        const P* vp = reinterpret_cast<const P*>(a.pool->row(a.value_kv, block, p % bs, g)) + a.value_offset;
        const float* vf;
        if constexpr (std::is_same_v<P, float>) vf = vp;
        else { V::to_f32(vp, kbuf, a.dv); vf = kbuf; }
        for (int64_t jh = j0 * a.group; jh < rows_g; ++jh) V::axpy(s[jh * n_kv + p], vf, acc + jh * a.dv, a.dv);
      }
      for (int64_t j = 0; j < n_q; ++j)
        for (int64_t h = 0; h < a.group; ++h) {
          const int64_t jh = j * a.group + h;
          const float* src = acc + jh * a.dv;
          Q* dst = out + (row0 + j) * out_row + (g * a.group + h) * a.dv;
          const float sum = sums[jh];
          for (int64_t d = 0; d < a.dv; ++d) dst[d] = from_f32<Q>(sum == 0.0f ? 0.0f : src[d] / sum);  // sum >= 1 or NaN
        }
    }
    row0 += n_q;
  }
  if (row0 < a.rows) std::memset(static_cast<void*>(out + row0 * out_row), 0, (a.rows - row0) * out_row * sizeof(Q));
}

MTP_ISA_KERNEL(run_attend, attend)

}  // namespace mtp
