// mtp::dsa_sparse_attention on CPU: absorbed MLA attention of each query row over its selected positions only
// (DeepSeek Sparse Attention; plugins/dsa_reference.py dsa_sparse_attention_ref, the model: models/dsa.py). The
// latent plane is an MLA pool plane (kv_kind 1): keys are the whole latent row, values its c_kv part
// (latent[rope_dim:]), as mla_paged_attention.cpp. selected [T, topk] holds each row's positions (-1 = unused slot;
// the selection of mtp::dsa_index_topk, ascending). Per row the selected latents are read from the pool once (to
// fp32) and serve every head; scores, softmax and the weighted sum are fp32 with attention.h's primitives in its
// order, each row alone (batch- and thread-invariant), so a row that selects every visible position (a request
// below index_topk) gets the bits of mtp::mla_paged_attention: the model's dense / sparse switch per forward cannot
// change a request's result.
// Returns [T, H, latent_dim - rope_dim] in q's dtype; rows past sum(q_counts) and rows with no selected position are
// zeros.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include "attention.h"

namespace mtp {
namespace {

struct SparseArgs {
  const void* q;  // [T, H, latent_dim]
  void* out;      // [T, H, value_dim]
  const int64_t* selected;
  int64_t topk, heads, latent_dim, rope_dim, cols;
  float scale;
  const Ints* tables;
  const PoolPlane* pool;
};

struct SparseRow {
  int64_t r, row;
};

template <class V, class Q, class P>
void sparse_rows(const SparseArgs& a, const SparseRow* rows, int64_t i0, int64_t i1) {
  const int64_t ld = a.latent_dim, dv = a.latent_dim - a.rope_dim, bs = a.pool->block_size;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = rows[i].r, t = rows[i].row;
    const int64_t* sel = a.selected + t * a.topk;
    float* lat = scratch(0, a.topk * ld + ld + dv);
    float* qf = lat + a.topk * ld;
    float* acc = qf + ld;
    float* s = scratch(1, a.topk);
    int64_t k = 0;
    for (int64_t j = 0; j < a.topk; ++j) {
      const int64_t p = sel[j];
      if (p < 0) continue;
      const P* src = reinterpret_cast<const P*>(a.pool->row(0, (*a.tables)[r * a.cols + p / bs], p % bs, 0));
      V::to_f32(src, lat + k * ld, ld);
      ++k;
    }
    Q* out = static_cast<Q*>(a.out) + t * a.heads * dv;
    const Q* q = static_cast<const Q*>(a.q) + t * a.heads * ld;
    for (int64_t h = 0; h < a.heads; ++h) {
      Q* dst = out + h * dv;
      if (k == 0) {
        for (int64_t d = 0; d < dv; ++d) dst[d] = from_f32<Q>(0.0f);
        continue;
      }
      // tiles of kTile selected rows, with attention.h's primitives in its order: a row whose selection is every
      // visible position in ascending order (below index_topk) gets mla_paged_attention's bits exactly
      V::to_f32(q + h * ld, qf, ld);
      const float* tile[kTile];
      float part[kTile];
      for (int64_t j0 = 0; j0 < k; j0 += kTile) {
        const int nk = static_cast<int>(std::min<int64_t>(kTile, k - j0));
        for (int c = 0; c < nk; ++c) tile[c] = lat + (j0 + c) * ld;
        dot_n<V>(nk, tile, qf, ld, part);
        for (int c = 0; c < nk; ++c) s[j0 + c] = part[c] * a.scale;
      }
      V::exp_sub(s, V::max(s, k), k);
      const float sum = V::sum(s, k);
      std::fill(acc, acc + dv, 0.0f);
      for (int64_t j0 = 0; j0 < k; j0 += kTile) {
        const int nk = static_cast<int>(std::min<int64_t>(kTile, k - j0));
        for (int c = 0; c < nk; ++c) tile[c] = lat + (j0 + c) * ld + a.rope_dim;
        axpy_n<V>(nk, s + j0, tile, acc, dv);
      }
      for (int64_t d = 0; d < dv; ++d) dst[d] = from_f32<Q>(sum == 0.0f ? 0.0f : acc[d] / sum);
    }
  }
}

MTP_ISA_KERNEL(run_sparse_rows, sparse_rows)

at::Tensor dsa_sparse_attention_cpu(const at::Tensor& q, const at::Tensor& q_counts, const at::Tensor& selected,
                                    const at::Tensor& block_tables, const at::Tensor& pool_ptr, int64_t plane,
                                    int64_t num_planes, int64_t num_blocks, int64_t block_size, int64_t latent_dim,
                                    int64_t dtype, int64_t rope_dim, double scale) {
  constexpr const char* op = "dsa_sparse_attention";
  check_float(q, op, "q");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == latent_dim, op, ": q must be [T, H, ", latent_dim, "], got ",
                    py_shape(q));
  TORCH_CHECK_VALUE(0 <= rope_dim && rope_dim < latent_dim, op, ": rope_dim ", rope_dim,
                    " must be in [0, latent_dim ", latent_dim, ")");
  TORCH_CHECK_VALUE(selected.scalar_type() == at::kLong && selected.dim() == 2 && selected.size(0) == q.size(0), op,
                    ": selected must be int64 [T, topk] with T = ", q.size(0), ", got ", selected.scalar_type(), " ",
                    py_shape(selected));
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == q_counts.numel(), op,
                    ": block_tables must be [R, max_blocks] with one row per q_counts entry");
  const PoolPlane pool = pool_plane(pool_ptr, plane, num_planes, num_blocks, block_size, 1, latent_dim, dtype, 1, op);
  const Ints qc = ints(q_counts, op, "q_counts"), t = ints(block_tables, op, "block_tables");
  const at::Tensor sel = selected.contiguous(), qq = q.contiguous();
  const int64_t topk = sel.size(1), cols = block_tables.size(1), num_requests = q_counts.numel();
  const int64_t* sp = sel.data_ptr<int64_t>();
  std::vector<SparseRow> rows;
  int64_t row = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK_VALUE(qc[r] >= 0, op, ": q_counts must be >= 0");
    for (int64_t j = 0; j < qc[r]; ++j, ++row) {
      TORCH_CHECK_VALUE(row < q.size(0), op, ": q_counts sum to more rows than q has (", q.size(0), ")");
      for (int64_t c = 0; c < topk; ++c) {  // every selected position must be in the request's table
        const int64_t p = sp[row * topk + c];
        if (p < 0) continue;
        TORCH_CHECK_VALUE(p / block_size < cols && t[r * cols + p / block_size] >= 0 &&
                              t[r * cols + p / block_size] < num_blocks,
                          op, ": row ", row, " selects position ", p, " whose block is not in request ", r,
                          "'s block table; select only cached positions");
      }
      rows.push_back({r, row});
    }
  }
  at::Tensor out = at::zeros({q.size(0), q.size(1), latent_dim - rope_dim}, q.options());
  const SparseArgs args{qq.data_ptr(), out.data_ptr(), sp, topk, q.size(1), latent_dim, rope_dim, cols,
                        static_cast<float>(scale), &t, &pool};
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t work = n * topk * q.size(1) * (2 * latent_dim - rope_dim);
  if (n > 0)
    dispatch_float2(q.scalar_type(), pool.dtype, [&](auto qt, auto pt) {
      at::parallel_for(0, n, grain_for(n, work), [&](int64_t i0, int64_t i1) {
        run_sparse_rows<decltype(qt), decltype(pt)>(args, rows.data(), i0, i1);
      });
    });
  return out;
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("dsa_sparse_attention", &mtp::dsa_sparse_attention_cpu); }
