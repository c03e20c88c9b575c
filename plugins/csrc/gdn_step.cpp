// mtp::gdn_step on CPU: one Gated DeltaNet layer's token mixing (Qwen3-Next / Qwen3.5) over the state pool,
// written in place through the pool addresses (plugins/gdn_pool.py's layout). Semantics: plugins/reference.py
// gdn_step_ref, row by row: the causal depthwise conv over the request's window (zeros for a fresh sequence),
// silu, l2-normalised q / k, then the gated delta rule S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
// After row t the window and S go to write_slots[t] (-1: not stored), so a verify step keeps one state per row
// and rollback is a slot choice. A request with 0 rows (padding) reads and writes nothing; a fresh one never
// reads its slot.
//
// Each request's rows in order (the recurrence is sequential); per row the work is Hv x Dk x Dv multiply-adds
// over a state that stays in L1 for these head sizes; requests and value heads on torch's threads (run_requests).
// Prompt rows: a run of >= kGdnMinChunkRun rows storing no state (all but maybe its last) takes the chunked form
// (gdn_chunk.h), which goes through S once per chunk of kGdnChunk rows; verify rows (each stores) stay row by row.
// Plain C++ the compiler vectorises (-O3; the row's two passes per ISA, gdn_row): the inner loops run over Dv,
// contiguous in the state. fp32 math, the pool's conv window in its own dtype.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <cmath>

#include "common.h"
#include "gdn_chunk.h"

namespace mtp {
namespace {

struct Gdn {
  const float* mixed;  // [T, C]
  const float* b;      // [T, Hv]
  const float* a;      // [T, Hv]
  const float* w;      // [K, C] the conv weights, transposed (channels contiguous: conv_rows's vectors)
  const float* a_log;  // [Hv]
  const float* dt_bias;
  char* conv;          // this layer's conv pool [S, C, K-1] (pool dtype)
  float* ssm;          // this layer's ssm pool [S, Hv, Dk, Dv]
  float* out;          // [T, Hv, Dv]
  int64_t c, kk, hk, hv, dk, dv;
};

MTP_INLINE float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// Every row's q | k | v after the conv, head by head: segment (q head i, k head i, v head h: channels off .. off +
// len of the conv) holds the op's T rows one after the other, [T, len] at xs + T * off. A head's rows are len floats
// apart, not C: the chunked form reads a chunk's Q, K and V as compact blocks (rows C floats apart are each on
// another page; perf put an eighth of the chunk's time in its first loads of K), and so does the row-by-row form.
struct GdnActs {
  float* xs;
  int64_t rows, dk, dv, kd;  // kd = Hk * Dk
  float* q(int64_t t, int64_t kh) const { return xs + rows * kh * dk + t * dk; }
  float* k(int64_t t, int64_t kh) const { return xs + rows * (kd + kh * dk) + t * dk; }
  float* v(int64_t t, int64_t h) const { return xs + rows * (2 * kd + h * dv) + t * dv; }
};

// One request's rows (packed rows row0 .. row0 + n - 1): where they start from and whether it is fresh.
struct GdnRequest {
  int64_t row0, n, read_slot;
  bool fresh;
};

// The causal conv of request q's rows, in order, with silu and the l2-normalised q / k heads (q also scaled by
// Dk^-0.5), into the acts' segments. After row t the window (the last K-1 inputs) goes to the conv pool at
// write_slots[t]. Vectorised over channels: the window and the weights are held transposed ([K-1, C], [K, C]), so
// input j of row t is a whole row, the window's or one of `mixed`, and each channel's sum is
// 0 + w_0 in_0 + ... + w_{K-1} in_{K-1} in that order, multiply then add (-ffp-contract=off): the same operations,
// so the same bits, as the channel-by-channel loop it replaced (perf: that scalar loop bounded both forms' prompt
// speed). The window in the calling thread's scratch slot 0, the silu exps in slot 5.
template <class V, class P>
void conv_rows_body(const Gdn& g, const GdnRequest& q, const Ints& writes, GdnActs acts) {
  const int64_t c = g.c, kk = g.kk, win = kk - 1, kd = g.hk * g.dk;
  float* window = scratch(0, c * win);  // [win, c] the request's starting window, transposed
  float* neg = scratch(5, std::max(g.dk, g.dv));
  if (q.fresh) {
    std::fill(window, window + c * win, 0.0f);
  } else {
    const P* src = reinterpret_cast<const P*>(g.conv) + q.read_slot * c * win;
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t j = 0; j < win; ++j) window[j * c + ch] = f32(src[ch * win + j]);
  }
  // input i of the request's sequence [window, its rows]: row i of the window, then row i - win of its rows
  auto input = [&](int64_t i) { return i < win ? window + i * c : g.mixed + (q.row0 + i - win) * c; };
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(g.dk));
  for (int64_t r = 0; r < q.n; ++r) {
    const int64_t t = q.row0 + r;
    for (int64_t seg = 0; seg < 2 * g.hk + g.hv; ++seg) {  // q heads, k heads, v heads
      const bool is_v = seg >= 2 * g.hk;
      const int64_t len = is_v ? g.dv : g.dk, off = is_v ? 2 * kd + (seg - 2 * g.hk) * g.dv : seg * g.dk;
      float* __restrict__ x = acts.xs + acts.rows * off + t * len;
      for (int64_t ch = 0; ch < len; ++ch) x[ch] = 0.0f;
      for (int64_t j = 0; j < kk; ++j) {
        const float* __restrict__ in = input(r + j) + off;
        const float* __restrict__ wj = g.w + j * c + off;
        for (int64_t ch = 0; ch < len; ++ch) x[ch] += in[ch] * wj[ch];
      }
      // silu(s) = s / (1 + exp(-s)), the exps of the segment at once (V's vector exp: a third of the prompt
      // rows' time went to a scalar expf per channel)
      for (int64_t ch = 0; ch < len; ++ch) neg[ch] = -x[ch];
      V::exp_sub(neg, 0.0f, len);
      for (int64_t ch = 0; ch < len; ++ch) x[ch] = x[ch] / (1.0f + neg[ch]);
    }
    for (int64_t h = 0; h < g.hk; ++h) {  // l2-normalise each q / k head (q also scaled by Dk^-0.5)
      float* qh = acts.q(t, h);
      float* kh = acts.k(t, h);
      float sq = 0.0f, sk = 0.0f;
      for (int64_t i = 0; i < g.dk; ++i) {
        sq += qh[i] * qh[i];
        sk += kh[i] * kh[i];
      }
      const float rq = q_scale / std::sqrt(sq + 1e-6f), rk = 1.0f / std::sqrt(sk + 1e-6f);
      for (int64_t i = 0; i < g.dk; ++i) {
        qh[i] *= rq;
        kh[i] *= rk;
      }
    }
    const int64_t slot = writes[t];
    if (slot >= 0) {  // the window after row t: inputs r + 1 .. r + win, back to the pool's [C, K-1]
      P* dst = reinterpret_cast<P*>(g.conv) + slot * c * win;
      for (int64_t j = 0; j < win; ++j) {
        const float* in = input(r + 1 + j);
        for (int64_t ch = 0; ch < c; ++ch) dst[ch * win + j] = from_f32<P>(in[ch]);
      }
    }
  }
}

// The shortest run of rows that takes the chunked form (gdn_chunk.h); settable through mtp::gdn_chunk_min_run (the
// tests and runtime/bench/gdn_prefill.py compare both forms on one build). A huge value: row by row everywhere.
std::atomic<int64_t> g_min_chunk_run{kGdnMinChunkRun};

MTP_ISA_KERNEL(conv_rows, conv_rows_body)

// One row of the gated delta rule on one value head's state [Dk, Dv]: S = decay * src into dst, then
// S <- S + k (beta (v - S^T k))^T and o += S^T q over dst, two passes over S (decay with S^T k, then the update with
// S^T q), each sum over Dk in order, multiply then add (-ffp-contract=off): every lane the scalar loop's operations.
// src is the pool's read slot (decode: no copy into scratch first) or dst itself; dst is the head's scratch state or,
// for a request's last row that stores, its pool slot (no copy out after). Compiled per ISA (MTP_ISA_KERNEL): baseline
// x86-64 vectorised these loops 4 lanes wide, and a decode token spent ~6% of its time here (docs/PERFORMANCE.md).
template <class V>
void gdn_row_body(const float* src, float* dst, float* __restrict__ d, const float* k, const float* q,
                  const float* v, float decay, float beta, float* __restrict__ o, int64_t dk, int64_t dv) {
  for (int64_t e = 0; e < dv; ++e) d[e] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* si = src + i * dv;
    float* __restrict__ ti = dst + i * dv;
    const float ki = k[i];
    for (int64_t e = 0; e < dv; ++e) {
      const float x = si[e] * decay;
      ti[e] = x;
      d[e] += x * ki;
    }
  }
  for (int64_t e = 0; e < dv; ++e) d[e] = (v[e] - d[e]) * beta;
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict__ ti = dst + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t e = 0; e < dv; ++e) {
      const float x = ti[e] + ki * d[e];
      ti[e] = x;
      o[e] += x * qi;
    }
  }
}
MTP_ISA_KERNEL(gdn_row, gdn_row_body)

// Value head h of request q over its rows, in order: the gated delta rule on S_h [Dk, Dv], o = S^T q into out, S_h to
// the ssm pool at write_slots[t] after row t. Reads x from conv_rows. Row by row, S_h lives in the calling thread's
// scratch slot 1, except that the first row reads the pool's read slot itself and a last row that stores writes its
// slot itself (gdn_row). A run of rows that store no state (write_slots -1, the run's last row may store) of at least
// g_min_chunk_run rows goes through the chunked form (gdn_chunk.h: prompt rows touch S once per chunk) on the scratch
// copy; shorter runs and rows that each store their state (verify rows) go row by row.
void head_rows(const Gdn& g, const GdnRequest& q, int64_t h, const Ints& writes, GdnActs acts) {
  const int64_t rep = g.hv / g.hk, head_size = g.dk * g.dv, state_size = g.hv * head_size;
  float* s = scratch(1, head_size);
  float* __restrict__ d = scratch(2, g.dv);
  const float* src = s;  // where S_h is now: the scratch copy or, until a row has run, the read slot
  if (q.fresh) std::fill(s, s + head_size, 0.0f);
  else src = g.ssm + q.read_slot * state_size + h * head_size;
  auto in_scratch = [&] {  // the chunked form works on the scratch copy
    if (src != s) std::memcpy(s, src, sizeof(float) * head_size);
    src = s;
  };
  const float a_scale = -std::exp(g.a_log[h]);
  auto log_decay = [&](int64_t t) { return a_scale * softplus(g.a[t * g.hv + h] + g.dt_bias[h]); };
  auto beta_of = [&](int64_t t) { return 1.0f / (1.0f + std::exp(-g.b[t * g.hv + h])); };
  auto slot_of = [&](int64_t t) { return g.ssm + writes[t] * state_size + h * head_size; };
  auto store = [&](int64_t t) {
    if (writes[t] >= 0) std::memcpy(slot_of(t), s, sizeof(float) * head_size);
  };
  const int64_t end = q.row0 + q.n;
  auto row = [&](int64_t t) {
    const bool last_stores = t == end - 1 && writes[t] >= 0;
    float* dst = last_stores ? slot_of(t) : s;
    gdn_row(src, dst, d, acts.k(t, h / rep), acts.q(t, h / rep), acts.v(t, h), std::exp(log_decay(t)), beta_of(t),
            g.out + (t * g.hv + h) * g.dv, g.dk, g.dv);  // out starts at zero
    src = dst;
    if (!last_stores) store(t);
  };
  const int64_t min_run = std::max<int64_t>(g_min_chunk_run.load(), 1);
  for (int64_t t = q.row0; t < end;) {
    int64_t last = t;  // the run: rows t..last, none but the last storing its state
    while (last + 1 < end && writes[last] < 0) ++last;
    if (last - t + 1 < min_run) {
      for (; t <= last; ++t) row(t);
      continue;
    }
    in_scratch();
    float* buf = scratch(4, gdn_chunk_scratch(g.dk, g.dv));
    float lg[kGdnChunk], beta[kGdnChunk];
    for (; t <= last; t += kGdnChunk) {  // leaves t past the run
      const int64_t n = std::min(kGdnChunk, last + 1 - t);
      for (int64_t i = 0; i < n; ++i) {
        lg[i] = log_decay(t + i);
        beta[i] = beta_of(t + i);
      }
      gdn_chunk(GdnChunkRows{acts.q(t, h / rep), acts.k(t, h / rep), acts.v(t, h), lg, beta,
                             g.out + (t * g.hv + h) * g.dv, n, g.hv * g.dv, g.dk, g.dv},
                s, buf);
    }
    store(last);
    t = last + 1;
  }
}

// Threads: the conv (all channels of a request, rows in order) runs per request, then the recurrence per (request,
// value head): the heads' states are disjoint slices of a slot and their rows' sums do not mix, so each output and
// state value is computed by one item by the same operations as one thread would (bit-identical for any thread
// count). Requests run at once only when none reads or writes a slot another one writes; otherwise (never from the
// engine, which gives each request its own slots) they run one after the other, in order, as the reference does.
template <class P>
void run_requests(const Gdn& g, const std::vector<GdnRequest>& reqs, const Ints& writes, int64_t num_slots,
                  GdnActs xs) {
  const int64_t nr = static_cast<int64_t>(reqs.size()), head_work = 4 * g.dk * g.dv;
  int64_t rows = 0;
  for (const auto& q : reqs) rows += q.n;
  std::vector<int64_t> writer(static_cast<size_t>(num_slots), -1);
  bool shared = false;
  for (int64_t r = 0; r < nr && !shared; ++r)
    for (int64_t t = reqs[r].row0; t < reqs[r].row0 + reqs[r].n; ++t)
      if (writes[t] >= 0) {
        int64_t& w = writer[writes[t]];
        shared = shared || (w >= 0 && w != r);
        w = r;
      }
  for (int64_t r = 0; r < nr && !shared; ++r)
    shared = !reqs[r].fresh && writer[reqs[r].read_slot] >= 0 && writer[reqs[r].read_slot] != r;
  const GdnRequest* rq = reqs.data();
  auto heads = [&](int64_t r0, int64_t r1, int64_t n_rows) {
    const int64_t items = (r1 - r0) * g.hv;
    at::parallel_for(0, items, grain_for(items, n_rows * g.hv * head_work), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) head_rows(g, rq[r0 + i / g.hv], i % g.hv, writes, xs);
    });
  };
  if (shared) {
    for (int64_t r = 0; r < nr; ++r) {
      conv_rows<P>(g, rq[r], writes, xs);
      heads(r, r + 1, rq[r].n);
    }
    return;
  }
  at::parallel_for(0, nr, grain_for(nr, rows * g.c * (g.kk + 8)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) conv_rows<P>(g, rq[r], writes, xs);
  });
  heads(0, nr, rows);
}

at::Tensor f32_contiguous(const at::Tensor& t, const char* name) {
  check_float(t, "gdn_step", name);
  return t.to(at::kFloat).contiguous();
}

// The conv weights [C, K] as conv_rows reads them, [K, C]: a plain loop (ATen's strided copy of the transposed view
// took ~75 us of a 128 KB weight per layer and decode step, more than the conv itself)
at::Tensor conv_rows_major(const at::Tensor& w) {
  const int64_t c = w.size(0), kk = w.size(1);
  at::Tensor t = at::empty({kk, c}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = t.data_ptr<float>();
  for (int64_t ch = 0; ch < c; ++ch)
    for (int64_t j = 0; j < kk; ++j) dst[j * c + ch] = src[ch * kk + j];
  return t;
}

at::Tensor gdn_step_cpu(const at::Tensor& mixed, const at::Tensor& b, const at::Tensor& a, const at::Tensor& q_counts,
                        const at::Tensor& starts, const at::Tensor& read_slots, const at::Tensor& write_slots,
                        const at::Tensor& conv_pool_ptr, const at::Tensor& ssm_pool_ptr, const at::Tensor& conv_weight,
                        const at::Tensor& a_log, const at::Tensor& dt_bias, int64_t layer, int64_t num_layers,
                        int64_t num_slots, int64_t conv_dim, int64_t conv_kernel, int64_t num_k_heads,
                        int64_t num_v_heads, int64_t head_k_dim, int64_t head_v_dim, int64_t dtype) {
  constexpr const char* op = "gdn_step";
  TORCH_CHECK_VALUE(conv_dim == 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim && conv_kernel >= 2 &&
                        num_k_heads > 0 && num_v_heads % num_k_heads == 0,
                    op, ": geometry conv_dim ", conv_dim, ", conv_kernel ", conv_kernel, ", heads ", num_k_heads, "/",
                    num_v_heads, ", dims ", head_k_dim, "/", head_v_dim,
                    " is inconsistent (conv_dim = 2 * Hk * Dk + Hv * Dv, Hv a multiple of Hk, conv_kernel >= 2)");
  TORCH_CHECK_VALUE(0 <= layer && layer < num_layers, op, ": GDN layer ", layer, " is outside the state pool's ",
                    num_layers, " layers");
  TORCH_CHECK_VALUE(mixed.dim() == 2 && mixed.size(1) == conv_dim && a.dim() == 2 && a.size(1) == num_v_heads &&
                        b.sizes() == a.sizes() && a.size(0) == mixed.size(0) && conv_weight.dim() == 2 &&
                        conv_weight.size(0) == conv_dim && conv_weight.size(1) == conv_kernel,
                    op, ": inputs mixed ", py_shape(mixed), ", b ", py_shape(b), ", a ", py_shape(a), ", conv_weight ",
                    py_shape(conv_weight), " do not match the node's geometry (conv_dim ", conv_dim, ", num_v_heads ",
                    num_v_heads, ", conv_kernel ", conv_kernel, ")");
  TORCH_CHECK_VALUE(a_log.numel() == num_v_heads && dt_bias.numel() == num_v_heads, op, ": a_log ", py_shape(a_log),
                    " and dt_bias ", py_shape(dt_bias), " must have num_v_heads = ", num_v_heads, " elements");
  const int64_t rows = mixed.size(0), reqs = q_counts.numel();
  TORCH_CHECK_VALUE(starts.numel() == reqs && read_slots.numel() == reqs && write_slots.numel() == rows, op,
                    ": q_counts ", py_shape(q_counts), ", starts ", py_shape(starts), " and read_slots ",
                    py_shape(read_slots), " must have one entry per request, write_slots ", py_shape(write_slots),
                    " one per row (", rows, ")");
  const Ints counts = ints(q_counts, op, "q_counts"), first = ints(starts, op, "starts");
  const Ints reads = ints(read_slots, op, "read_slots"), writes = ints(write_slots, op, "write_slots");
  int64_t total = 0;
  for (int64_t r = 0; r < reqs; ++r) {
    TORCH_CHECK_VALUE(counts[r] >= 0, op, ": q_counts[", r, "] = ", counts[r], " is negative");
    total += counts[r];
    TORCH_CHECK_VALUE(counts[r] == 0 || first[r] == 0 || (0 <= reads[r] && reads[r] < num_slots), op,
                      ": read_slots[", r, "] = ", reads[r], " is outside the pool's ", num_slots, " slots");
  }
  TORCH_CHECK_VALUE(total <= rows, op, ": q_counts add up to ", total, " rows, but mixed has ", rows);
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK_VALUE(writes[t] < num_slots, op, ": write_slots[", t, "] = ", writes[t], " is outside the pool's ",
                      num_slots, " slots");
  TORCH_CHECK_VALUE(conv_pool_ptr.numel() == 1 && ssm_pool_ptr.numel() == 1 &&
                        conv_pool_ptr.scalar_type() == c10::ScalarType::Long &&
                        ssm_pool_ptr.scalar_type() == c10::ScalarType::Long,
                    op, ": conv_pool_ptr and ssm_pool_ptr must be int64[1] addresses");
  const int64_t conv_addr = conv_pool_ptr.item<int64_t>(), ssm_addr = ssm_pool_ptr.item<int64_t>();
  TORCH_CHECK_VALUE(conv_addr != 0 && ssm_addr != 0, op,
                    ": GDN state pool address is 0: the engine passed no state pool");
  at::Tensor out = at::zeros({rows, num_v_heads, head_v_dim}, mixed.options().dtype(at::kFloat));
  if (rows == 0 || total == 0) return out;
  const at::Tensor xm = f32_contiguous(mixed, "mixed"), xb = f32_contiguous(b, "b"), xa = f32_contiguous(a, "a");
  const at::Tensor w = conv_rows_major(f32_contiguous(conv_weight, "conv_weight")), al = f32_contiguous(a_log, "a_log");
  const at::Tensor dt = f32_contiguous(dt_bias, "dt_bias");
  const int64_t win = conv_kernel - 1, state_size = num_v_heads * head_k_dim * head_v_dim;
  auto run = [&](auto p) {
    using P = decltype(p);
    char* conv = reinterpret_cast<char*>(conv_addr) +
                 static_cast<int64_t>(sizeof(P)) * layer * num_slots * conv_dim * win;
    float* ssm = reinterpret_cast<float*>(ssm_addr) + layer * num_slots * state_size;
    const Gdn g{xm.data_ptr<float>(), xb.data_ptr<float>(), xa.data_ptr<float>(), w.data_ptr<float>(),
                al.data_ptr<float>(), dt.data_ptr<float>(), conv, ssm, out.data_ptr<float>(), conv_dim, conv_kernel,
                num_k_heads, num_v_heads, head_k_dim, head_v_dim};
    std::vector<GdnRequest> work;
    int64_t row0 = 0;
    for (int64_t r = 0; r < reqs; ++r) {
      if (counts[r] > 0) work.push_back({row0, counts[r], reads[r], first[r] == 0});
      row0 += counts[r];
    }
    // every row's q | k | v after the conv, shared by the head items: a caller's scratch slot no body takes
    const GdnActs acts{scratch(3, total * conv_dim), total, head_k_dim, head_v_dim, num_k_heads * head_k_dim};
    run_requests<P>(g, work, writes, num_slots, acts);
  };
  switch (dtype) {
    case 0: run(float{}); break;
    case 1: run(c10::Half{}); break;
    case 2: run(c10::BFloat16{}); break;
    default: TORCH_CHECK_VALUE(false, op, ": conv pool dtype code ", dtype, " is none of 0 (fp32), 1 (fp16), 2 (bf16)");
  }
  return out;
}

}  // namespace

// "mtp::gdn_chunk_min_run": -1 reads the shortest run that takes the chunked form, n >= 1 sets it (registration.cpp).
int64_t gdn_chunk_min_run(int64_t set) {
  TORCH_CHECK_VALUE(set == -1 || set >= 1, "mtp::gdn_chunk_min_run: ", set,
                    " is not a run length (>= 1, or -1 to read the current one)");
  if (set >= 1) g_min_chunk_run.store(set);
  return g_min_chunk_run.load();
}

}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("gdn_step", &mtp::gdn_step_cpu); }
