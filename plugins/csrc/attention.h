// Causal paged attention over one pool plane, shared by paged_attention.cpp (GQA) and
// mla_paged_attention.cpp (absorbed MLA: one latent "KV head", keys = the latent, values = its c_kv part).
//
// Per request r and KV head g, up to 64 query rows of that head (a chunk of queries x group) are attended
// together: each key row the chunk sees is read from the pool once per chunk (converted to fp32 once) and dotted
// with every query of the chunk that sees it; query j sits at
// kv_lens[r] - q_counts[r] + j and sees keys 0..that. Scores, softmax and the weighted value sum are fp32,
// each query row computed alone (the same operations whatever the batch). Rows past sum(q_counts) are zeros;
// a query that sees no key (kv_len < q_count) is zeros too. Semantics: plugins/reference.py. The (request, KV head,
// chunk) items run on torch's threads (attend below).
//
// Sliding-window mode (mtp::swa_paged_attention, plugins/reference_swa.py): window > 0 lets query position q see
// keys q - window + 1 .. q only (transformers' `sliding_window` convention: the query itself counts), and sinks
// (one logit per query head) add exp(sink_h - m) to each softmax denominator, m = max(scores, sink_h), as
// transformers' eager attention with `s_aux` does. Keys left of every window of a chunk are never read.
#pragma once

#include <ATen/Parallel.h>

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
  int64_t window = 0;            // > 0: sliding window (keys q - window + 1 .. q); 0: causal over every key
  const float* sinks = nullptr;  // [Hq] per-head sink logits, or none
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

constexpr int kTile = 4;  // keys (values) read per pass over the queries

template <class V, class P>
MTP_INLINE int key_tile(const AttendArgs& a, int64_t r, int64_t g, int64_t p0, int64_t n, int64_t kv, int64_t offset,
                        int64_t width, float* buf, const float** rows) {
  const int nk = static_cast<int>(std::min<int64_t>(kTile, n - p0));
  const int64_t bs = a.pool->block_size;
  for (int i = 0; i < nk; ++i) {
    const int64_t p = p0 + i;
    int64_t block = (*a.tables)[r * a.cols + p / bs];
    if (block < 0) block = 0;  // a hole inside kv_len reads the null block (outside the contract)
    const P* src = reinterpret_cast<const P*>(a.pool->row(kv, block, p % bs, g)) + offset;
    if constexpr (std::is_same_v<P, float>) {
      rows[i] = src;
    } else {
      V::to_f32(src, buf + i * width, width);
      rows[i] = buf + i * width;
    }
  }
  return nk;
}

constexpr int64_t kChunkRows = 64;  // query rows (x group) attended together: bounds the score buffer

// One work item: request r (its queries start at packed row row0), KV head g, queries ja .. jb - 1 of the request,
// query heads h0 .. h1 - 1 of the KV head's group.
struct AttendItem {
  int64_t r, row0, g, ja, jb, h0, h1;
};

// Items i0 .. i1 - 1 on the calling thread, with its own scratch (common.h). An ISA kernel of its own (not a lambda
// inside one): the body of at::parallel_for is called through OpenMP's outlined function, so it would not be
// compiled for the ISA of the function that contains it.
template <class V, class Q, class P>
void attend_items(const AttendArgs& a, const AttendItem* items, int64_t i0, int64_t i1) {
  const Q* q = static_cast<const Q*>(a.q);
  Q* out = static_cast<Q*>(a.out);
  const int64_t hq = a.kv_heads * a.group;
  const int64_t q_row = hq * a.dk, out_row = hq * a.dv, width = std::max(a.dk, a.dv);
  const float* tile[kTile];
  float part[kTile];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = items[i].r, row0 = items[i].row0, g = items[i].g, ja = items[i].ja, jb = items[i].jb;
    const int64_t h0 = items[i].h0, gh = items[i].h1 - h0;  // the item's query heads; row l: query ja + l / gh
    const int64_t n_q = (*a.q_counts)[r], n_kv = (*a.kv_lens)[r];
    const int64_t first = n_kv - n_q;  // position of query 0; query j sees keys 0..first+j
    const int64_t rows = (jb - ja) * gh;
    float* qf = scratch(0, rows * a.dk + kTile * width + rows);
    float* kbuf = qf + rows * a.dk;
    float* sums = kbuf + kTile * width;
    float* s = scratch(1, rows * std::max<int64_t>(n_kv, 1));
    float* acc = scratch(2, rows * a.dv);
    const int64_t kv_end = std::min(n_kv, first + jb);  // keys any query of the chunk sees
    // first key any query of the chunk sees (the window of its first query); lo(l): row l's first key
    const int64_t kv_begin = a.window > 0 ? std::max<int64_t>(0, first + ja - a.window + 1) : 0;
    for (int64_t j = ja; j < jb; ++j)
      for (int64_t h = 0; h < gh; ++h)
        V::to_f32(q + (row0 + j) * q_row + (g * a.group + h0 + h) * a.dk, qf + ((j - ja) * gh + h) * a.dk, a.dk);
    // scores of a tile of keys against every query that sees its first key (the rest of a row is ignored)
    for (int64_t p0 = kv_begin; p0 < kv_end; p0 += kTile) {
      const int64_t l0 = (std::max(ja, p0 - first) - ja) * gh;
      const int nk = key_tile<V, P>(a, r, g, p0, kv_end, 0, 0, a.dk, kbuf, tile);
      for (int64_t l = l0; l < rows; ++l) {
        dot_n<V>(nk, tile, qf + l * a.dk, a.dk, part);
        for (int k = 0; k < nk; ++k) s[l * n_kv + p0 + k] = part[k] * a.scale;
      }
    }
    // softmax numerators and sums over each query's visible keys (its window), plus its head's sink
    for (int64_t l = 0; l < rows; ++l) {
      const int64_t qpos = first + ja + l / gh;
      const int64_t len = std::min(qpos + 1, n_kv);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qpos - a.window + 1) : 0;
      if (len - lo <= 0) { sums[l] = 0.0f; continue; }
      float* row = s + l * n_kv + lo;
      float m = V::max(row, len - lo);
      const float sink = a.sinks ? a.sinks[g * a.group + h0 + l % gh] : 0.0f;
      if (a.sinks) m = std::max(m, sink);
      V::exp_sub(row, m, len - lo);
      sums[l] = V::sum(row, len - lo) + (a.sinks ? std::exp(sink - m) : 0.0f);
      std::fill(s + l * n_kv + kv_begin, row, 0.0f);  // keys of the chunk left of this row's window weigh 0
    }
    // weighted values, a tile of value rows at a time, each query's sum in key order
    std::fill(acc, acc + rows * a.dv, 0.0f);
    for (int64_t p0 = kv_begin; p0 < kv_end; p0 += kTile) {
      const int64_t l0 = (std::max(ja, p0 - first) - ja) * gh;
      const int nk = key_tile<V, P>(a, r, g, p0, kv_end, a.value_kv, a.value_offset, a.dv, kbuf, tile);
      for (int64_t l = l0; l < rows; ++l) {
        const int seen = static_cast<int>(std::min<int64_t>(nk, first + ja + l / gh + 1 - p0));
        axpy_n<V>(seen, s + l * n_kv + p0, tile, acc + l * a.dv, a.dv);
      }
    }
    for (int64_t l = 0; l < rows; ++l) {
      const float* src = acc + l * a.dv;
      Q* dst = out + (row0 + ja + l / gh) * out_row + (g * a.group + h0 + l % gh) * a.dv;
      const float sum = sums[l];  // >= 1 (the max term) or 0 (no key); NaN propagates
      for (int64_t d = 0; d < a.dv; ++d) dst[d] = from_f32<Q>(sum == 0.0f ? 0.0f : src[d] / sum);
    }
  }
}

MTP_ISA_KERNEL(run_attend_items, attend_items)

// Threads: the items (request x KV head x chunk of up to 64 query rows) are independent (each writes its own
// output rows and only reads the pool), so at::parallel_for runs them on torch's threads, with a grain that keeps
// a small call (decode of a small model) inline. Request x head is the natural split (the GQA group's queries share
// each key row read); the chunks add items for long prefills. An output value is computed inside one item by the
// same operations whatever the chunking (every query row has its own scores, softmax and accumulator; a key tile
// is dotted with each row alone), so results are bit-identical for any thread count and batch (decode rows equal
// verify rows).
//
// Fewer items than threads (a decode step of MLA, whose 16-128 heads are one group over one latent "KV head", or
// of a few requests of a GQA model with few KV heads): the group's heads are split into parts too, so every thread
// gets work. A part converts the key rows it reads for itself (once per part instead of once per group), and its
// rows' values are the same as in a whole group (each row alone).
template <class Q, class P>
void attend(const AttendArgs& a) {
  const int64_t chunk = std::max<int64_t>(1, kChunkRows / a.group);  // queries per chunk
  int64_t chunks = 0, work = 0;
  for (int64_t r = 0; r < a.num_requests; ++r) {
    const int64_t n_q = (*a.q_counts)[r], n_kv = (*a.kv_lens)[r];
    if (n_q == 0) continue;
    chunks += a.kv_heads * ((n_q + chunk - 1) / chunk);
    work += n_q * a.group * a.kv_heads * std::max<int64_t>(n_kv, 1) * (a.dk + a.dv);  // scores + values, about
  }
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1;  // of each group
  if (chunks > 0 && chunks < threads && work >= 2 * kMinThreadWork)
    parts = std::min(a.group, (threads + chunks - 1) / chunks);
  const int64_t per_part = (a.group + parts - 1) / parts;
  std::vector<AttendItem> items;
  int64_t row0 = 0;
  for (int64_t r = 0; r < a.num_requests; ++r) {
    const int64_t n_q = (*a.q_counts)[r];
    if (n_q == 0) continue;
    for (int64_t g = 0; g < a.kv_heads; ++g)
      for (int64_t ja = 0; ja < n_q; ja += chunk)
        for (int64_t h0 = 0; h0 < a.group; h0 += per_part)
          items.push_back({r, row0, g, ja, std::min(n_q, ja + chunk), h0, std::min(a.group, h0 + per_part)});
    row0 += n_q;
  }
  const int64_t n = static_cast<int64_t>(items.size());
  if (n > 0)
    at::parallel_for(0, n, grain_for(n, work), [&](int64_t i0, int64_t i1) {
      run_attend_items<Q, P>(a, items.data(), i0, i1);
    });
  if (row0 < a.rows) {
    const int64_t out_row = a.kv_heads * a.group * a.dv;
    std::memset(static_cast<char*>(a.out) + row0 * out_row * sizeof(Q), 0, (a.rows - row0) * out_row * sizeof(Q));
  }
}

// Checks and runs one attention over the pool (GQA or MLA: the args say which) for queries of dtype q_type.
inline void attend_pool(const AttendArgs& args, c10::ScalarType q_type, c10::ScalarType pool_type) {
  check_attend(args);
  dispatch_float2(q_type, pool_type, [&](auto qt, auto pt) { attend<decltype(qt), decltype(pt)>(args); });
}

}  // namespace mtp
