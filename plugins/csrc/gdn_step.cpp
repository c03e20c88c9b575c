// mtp::gdn_step on CPU: one Gated DeltaNet layer's token mixing (Qwen3-Next / Qwen3.5) over the state pool,
// written in place through the pool addresses (plugins/gdn_pool.py's layout). Semantics: plugins/reference.py
// gdn_step_ref, row by row: the causal depthwise conv over the request's window (zeros for a fresh sequence),
// silu, l2-normalised q / k, then the gated delta rule S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
// After row t the window and S go to write_slots[t] (-1: not stored), so a verify step keeps one state per row
// and rollback is a slot choice. A request with 0 rows (padding) reads and writes nothing; a fresh one never
// reads its slot.
//
// One request at a time, its rows in order (the recurrence is sequential); per row the work is Hv x Dk x Dv
// multiply-adds over a state that stays in L1 for these head sizes. Plain C++ the compiler vectorises (-O3): the
// inner loops run over Dv, contiguous in the state. fp32 math, the pool's conv window in its own dtype.
#include <torch/library.h>

#include <ATen/ops/zeros.h>

#include <cmath>

#include "common.h"

namespace mtp {
namespace {

struct Gdn {
  const float* mixed;  // [T, C]
  const float* b;      // [T, Hv]
  const float* a;      // [T, Hv]
  const float* w;      // [C, K]
  const float* a_log;  // [Hv]
  const float* dt_bias;
  char* conv;          // this layer's conv pool [S, C, K-1] (pool dtype)
  float* ssm;          // this layer's ssm pool [S, Hv, Dk, Dv]
  float* out;          // [T, Hv, Dv]
  int64_t c, kk, hk, hv, dk, dv;
};

MTP_INLINE float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

template <class P>
void request(const Gdn& g, int64_t row0, int64_t n, bool fresh, int64_t read_slot, const Ints& writes) {
  const int64_t c = g.c, win = g.kk - 1, kd = g.hk * g.dk, rep = g.hv / g.hk, state_size = g.hv * g.dk * g.dv;
  // the per-thread scratch buffers (no allocation per request): conv window, one row's q|k|v, state, delta
  float *window = scratch(0, c * win), *x = scratch(1, c), *state = scratch(2, state_size), *delta = scratch(3, g.dv);
  if (fresh) {
    std::fill(window, window + c * win, 0.0f);
    std::fill(state, state + state_size, 0.0f);
  } else {
    const P* src = reinterpret_cast<const P*>(g.conv) + read_slot * c * win;
    for (int64_t i = 0; i < c * win; ++i) window[i] = f32(src[i]);
    std::memcpy(state, g.ssm + read_slot * state_size, sizeof(float) * state_size);
  }
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(g.dk));
  for (int64_t t = row0; t < row0 + n; ++t) {
    const float* in = g.mixed + t * c;
    for (int64_t ch = 0; ch < c; ++ch) {  // conv over [window, input], then the window slides by one
      float* wn = window + ch * win;
      const float* wt = g.w + ch * g.kk;
      float s = 0.0f;
      for (int64_t j = 0; j < win; ++j) s += wn[j] * wt[j];
      s += in[ch] * wt[win];
      x[ch] = s / (1.0f + std::exp(-s));  // silu
      for (int64_t j = 0; j + 1 < win; ++j) wn[j] = wn[j + 1];
      wn[win - 1] = in[ch];
    }
    for (int64_t h = 0; h < g.hk; ++h) {  // l2-normalise each q / k head (q also scaled by Dk^-0.5)
      float* q = x + h * g.dk;
      float* k = x + kd + h * g.dk;
      float sq = 0.0f, sk = 0.0f;
      for (int64_t i = 0; i < g.dk; ++i) {
        sq += q[i] * q[i];
        sk += k[i] * k[i];
      }
      const float rq = q_scale / std::sqrt(sq + 1e-6f), rk = 1.0f / std::sqrt(sk + 1e-6f);
      for (int64_t i = 0; i < g.dk; ++i) {
        q[i] *= rq;
        k[i] *= rk;
      }
    }
    for (int64_t h = 0; h < g.hv; ++h) {
      const float* q = x + (h / rep) * g.dk;
      const float* k = x + kd + (h / rep) * g.dk;
      const float* v = x + 2 * kd + h * g.dv;
      const float decay = std::exp(-std::exp(g.a_log[h]) * softplus(g.a[t * g.hv + h] + g.dt_bias[h]));
      const float beta = 1.0f / (1.0f + std::exp(-g.b[t * g.hv + h]));
      float* s = state + h * g.dk * g.dv;  // [Dk, Dv]: two passes over it (decay with S^T k, then the
      float* __restrict__ d = delta;  // update with S^T q); each sum runs over Dk in order
      for (int64_t e = 0; e < g.dv; ++e) d[e] = 0.0f;
      for (int64_t i = 0; i < g.dk; ++i) {
        float* __restrict__ si = s + i * g.dv;
        const float ki = k[i];
        for (int64_t e = 0; e < g.dv; ++e) {
          si[e] *= decay;
          d[e] += si[e] * ki;
        }
      }
      for (int64_t e = 0; e < g.dv; ++e) d[e] = (v[e] - d[e]) * beta;
      float* __restrict__ o = g.out + (t * g.hv + h) * g.dv;  // starts at zero
      for (int64_t i = 0; i < g.dk; ++i) {
        float* __restrict__ si = s + i * g.dv;
        const float ki = k[i], qi = q[i];
        for (int64_t e = 0; e < g.dv; ++e) {
          si[e] += ki * d[e];
          o[e] += si[e] * qi;
        }
      }
    }
    const int64_t slot = writes[t];
    if (slot >= 0) {
      P* dst = reinterpret_cast<P*>(g.conv) + slot * c * win;
      for (int64_t i = 0; i < c * win; ++i) dst[i] = from_f32<P>(window[i]);
      std::memcpy(g.ssm + slot * state_size, state, sizeof(float) * state_size);
    }
  }
}

at::Tensor f32_contiguous(const at::Tensor& t, const char* name) {
  check_float(t, "gdn_step", name);
  return t.to(at::kFloat).contiguous();
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
  const at::Tensor w = f32_contiguous(conv_weight, "conv_weight"), al = f32_contiguous(a_log, "a_log");
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
    int64_t row0 = 0;
    for (int64_t r = 0; r < reqs; ++r) {
      if (counts[r] > 0) request<P>(g, row0, counts[r], first[r] == 0, reads[r], writes);
      row0 += counts[r];
    }
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
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("gdn_step", &mtp::gdn_step_cpu); }
