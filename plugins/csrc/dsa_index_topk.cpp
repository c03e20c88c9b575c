// mtp::dsa_index_topk on CPU: DeepSeek Sparse Attention's lightning-indexer selection (plugins/dsa_reference.py
// dsa_index_topk_ref; the model: models/dsa.py). The indexer keys live in one plane of an MLA pool (kv_kind 1), a key
// in the first head_dim values of its row. For query row j of request r (position n_kv - n_q + j) every visible
// position s gets I(s) = sum_h w[h] * relu(scale * q[h] . k[s]), and the row keeps the topk best (ties to the lower
// position): int64 [T, topk] in ascending position order (the sparse attention sums in that order); slots past the
// visible count and rows past sum(q_counts) are -1.
// Scores are fp32 (V::dot per head, the heads summed in order), each row computed alone: thread- and
// batch-invariant like the attention kernels (attention.h).
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <numeric>

#include "common.h"

namespace mtp {
namespace {

struct IndexArgs {
  const float* q;        // [T, heads, dim]
  const float* weights;  // [T, heads]
  int64_t* out;          // [T, topk]
  int64_t heads, dim, topk, cols;
  float scale;
  const Ints* tables;
  const PoolPlane* pool;
};

struct IndexRow {
  int64_t r, row, visible;  // request, packed row, positions it sees (0..visible-1)
};

template <class V, class P>
void index_rows(const IndexArgs& a, const IndexRow* rows, int64_t i0, int64_t i1) {
  const int64_t bs = a.pool->block_size;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = rows[i].r, t = rows[i].row, visible = rows[i].visible;
    float* scores = scratch(0, visible + a.dim);
    float* key = scores + visible;
    const float* q = a.q + t * a.heads * a.dim;
    const float* w = a.weights + t * a.heads;
    for (int64_t s = 0; s < visible; ++s) {
      int64_t block = (*a.tables)[r * a.cols + s / bs];
      if (block < 0) block = 0;  // a hole inside kv_len reads the null block (outside the contract)
      const P* src = reinterpret_cast<const P*>(a.pool->row(0, block, s % bs, 0));
      const float* k;
      if constexpr (std::is_same_v<P, float>) {
        k = src;
      } else {
        V::to_f32(src, key, a.dim);
        k = key;
      }
      float score = 0.0f;
      for (int64_t h = 0; h < a.heads; ++h) {
        const float d = V::dot(q + h * a.dim, k, a.dim) * a.scale;
        score += w[h] * (d > 0.0f ? d : 0.0f);
      }
      scores[s] = score;
    }
    const int64_t k = std::min(a.topk, visible);
    int64_t* out = a.out + t * a.topk;
    static thread_local std::vector<int64_t> order;  // this thread's own (each row is sorted by one thread)
    order.resize(visible);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [scores](int64_t x, int64_t y) {
      return scores[x] > scores[y] || (scores[x] == scores[y] && x < y);
    });
    std::sort(order.begin(), order.begin() + k);  // ascending positions: the sparse attention's summation order
    std::copy(order.begin(), order.begin() + k, out);
  }
}

MTP_ISA_KERNEL(run_index_rows, index_rows)

at::Tensor dsa_index_topk_cpu(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& q_counts,
                              const at::Tensor& kv_lens, const at::Tensor& block_tables, const at::Tensor& pool_ptr,
                              int64_t plane, int64_t num_planes, int64_t num_blocks, int64_t block_size,
                              int64_t row_dim, int64_t dtype, int64_t topk, double scale) {
  constexpr const char* op = "dsa_index_topk";
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat, op,
                    ": q and weights must be float32 (the indexer scores in fp32)");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) <= row_dim, op, ": q must be [T, heads, dim] with dim <= the pool row ",
                    row_dim, ", got ", py_shape(q));
  TORCH_CHECK_VALUE(weights.dim() == 2 && weights.size(0) == q.size(0) && weights.size(1) == q.size(1), op,
                    ": weights must be [T, heads] = [", q.size(0), ", ", q.size(1), "], got ", py_shape(weights));
  TORCH_CHECK_VALUE(topk >= 1, op, ": topk must be >= 1, got ", topk);
  TORCH_CHECK_VALUE(block_tables.dim() == 2, op, ": block_tables must be [R, max_blocks]");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, 1, row_dim, dtype, 1, op);
  const Ints qc = ints(q_counts, op, "q_counts"), kl = ints(kv_lens, op, "kv_lens");
  const Ints t = ints(block_tables, op, "block_tables");
  const int64_t num_requests = q_counts.numel(), cols = block_tables.size(1);
  TORCH_CHECK_VALUE(kv_lens.numel() == num_requests && block_tables.size(0) == num_requests, op,
                    ": q_counts, kv_lens and block_tables must have one entry per request");
  std::vector<IndexRow> rows;
  int64_t row = 0, work = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t n_q = qc[r], n_kv = kl[r];
    TORCH_CHECK_VALUE(n_q >= 0 && n_kv >= n_q, op, ": request ", r, " has q_counts ", n_q, " and kv_lens ", n_kv,
                      "; kv_lens must count this forward's rows too (>= q_counts >= 0)");
    if (n_q == 0) continue;
    TORCH_CHECK_VALUE((n_kv - 1) / block_size < cols, op, ": kv_lens ", n_kv, " need more than the ", cols,
                      " block-table columns given; pass wider block tables");
    for (int64_t c = 0; c <= (n_kv - 1) / block_size; ++c)
      TORCH_CHECK_VALUE(t[r * cols + c] < num_blocks, op, ": block id ", t[r * cols + c], " (request ", r,
                        ") is outside the pool's ", num_blocks, " blocks");
    for (int64_t j = 0; j < n_q; ++j) rows.push_back({r, row + j, n_kv - n_q + j + 1});
    work += n_q * n_kv * q.size(1) * q.size(2);
    row += n_q;
  }
  TORCH_CHECK_VALUE(row <= q.size(0), op, ": q_counts sum to ", row, " rows but q has ", q.size(0));
  at::Tensor out = at::full({q.size(0), topk}, -1, q.options().dtype(at::kLong));
  const at::Tensor qq = q.contiguous(), ww = weights.contiguous();
  const IndexArgs args{qq.data_ptr<float>(), ww.data_ptr<float>(), out.data_ptr<int64_t>(), q.size(1), q.size(2),
                       topk, cols, static_cast<float>(scale), &t, &pool};
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n > 0)
    dispatch_float(pool.dtype, [&](auto pt) {
      at::parallel_for(0, n, grain_for(n, work), [&](int64_t i0, int64_t i1) {
        run_index_rows<decltype(pt)>(args, rows.data(), i0, i1);
      });
    });
  return out;
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("dsa_index_topk", &mtp::dsa_index_topk_cpu); }
