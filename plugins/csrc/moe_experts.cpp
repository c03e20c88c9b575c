// mtp::moe_experts and mtp::moe_experts_local on CPU: the routed experts of each token, reading only the
// selected experts' weights, in place (no gather copy), fp32 math over fp32 / fp16 / bf16 weights.
//
// Pairs (token, slot) are grouped by local expert; each weight row of an expert is read once and dotted with
// up to 4 of its tokens at a time (AVX2: tiles of 4 weight rows x 2 tokens, common.h rows_dot). Each pair's expert output lands in its own fp32 row, and a token's output
// sums its slots in slot order, so a token's result never depends on the rest of the batch. Semantics:
// plugins/reference.py moe_experts_ref (experts outside [offset, offset + E_local) contribute 0).
// ep_size > 1 or tp_size > 1: moe_experts calls mtp::moe_experts_exchange (Python, mpi4py; plugins/moe_ep.py),
// whose per-rank compute is moe_experts_local again. No per-forward plan: grouping the pairs is one pass.
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include "common.h"

namespace mtp {
namespace {

struct MoeArgs {
  const float* x;        // [T, H] fp32
  const float* weights;  // [T, K] fp32
  const int64_t* experts;  // [T, K] local expert of each pair, -1 = held elsewhere
  const void* w_gate_up;  // [E, 2I, H]
  const void* w_down;     // [E, H, I]
  float* out;             // [T, H] fp32
  int64_t tokens, top_k, hidden, inter, num_local;
};

template <class V, class W>
void experts(const MoeArgs& a) {
  const int64_t pairs = a.tokens * a.top_k, two_i = 2 * a.inter;
  const W* w_gu = static_cast<const W*>(a.w_gate_up);
  const W* w_dn = static_cast<const W*>(a.w_down);
  // pairs grouped by expert (counting sort; token order kept within one expert)
  thread_local std::vector<int64_t> start, order;
  start.assign(static_cast<size_t>(a.num_local + 1), 0);
  order.resize(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p)
    if (a.experts[p] >= 0) ++start[a.experts[p] + 1];
  for (int64_t e = 0; e < a.num_local; ++e) start[e + 1] += start[e];
  {
    thread_local std::vector<int64_t> fill;
    fill.assign(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p)
      if (a.experts[p] >= 0) order[fill[a.experts[p]]++] = p;
  }
  float* y = scratch(0, pairs * a.hidden);    // each pair's expert output
  float* gu = scratch(1, 4 * two_i);          // gate|up of up to 4 pairs
  float* h = scratch(2, 4 * a.inter);         // silu(gate) * up
  for (int64_t e = 0; e < a.num_local; ++e) {
    const W* wg = w_gu + e * two_i * a.hidden;
    const W* wd = w_dn + e * a.hidden * a.inter;
    for (int64_t c = start[e]; c < start[e + 1]; c += 4) {
      const int nx = static_cast<int>(std::min<int64_t>(4, start[e + 1] - c));
      const float* xs[4];
      const float* hs[4];
      float* gus[4];
      float* ys[4];
      for (int i = 0; i < nx; ++i) {
        xs[i] = a.x + (order[c + i] / a.top_k) * a.hidden;
        hs[i] = h + i * a.inter;
        gus[i] = gu + i * two_i;
        ys[i] = y + order[c + i] * a.hidden;
      }
      rows_dot<V>(nx, xs, wg, a.hidden, two_i, a.hidden, gus);
      for (int i = 0; i < nx; ++i) V::silu_mul(gu + i * two_i, gu + i * two_i + a.inter, h + i * a.inter, a.inter);
      rows_dot<V>(nx, hs, wd, a.inter, a.hidden, a.inter, ys);
    }
  }
  for (int64_t t = 0; t < a.tokens; ++t) {
    float* dst = a.out + t * a.hidden;
    std::fill(dst, dst + a.hidden, 0.0f);
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int64_t p = t * a.top_k + k;
      if (a.experts[p] >= 0) V::axpy(a.weights[p], y + p * a.hidden, dst, a.hidden);
    }
  }
}

MTP_ISA_KERNEL(run_experts, experts)

template <class T>
void copy_to_f32(const at::Tensor& t, float* dst) {
  const T* src = t.data_ptr<T>();
  for (int64_t i = 0; i < t.numel(); ++i) dst[i] = f32(src[i]);
}

at::Tensor moe_experts_local_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                 const at::Tensor& w_gate_up, const at::Tensor& w_down, int64_t expert_offset) {
  constexpr const char* op = "moe_experts";
  check_float(x, op, "x");
  check_float(topk_weights, op, "topk_weights");
  check_float(w_gate_up, op, "w_gate_up");
  TORCH_CHECK_VALUE(w_down.scalar_type() == w_gate_up.scalar_type(), op, ": w_gate_up and w_down must have one dtype");
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [T, H], got ", x.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(), op,
                    ": topk_ids and topk_weights must be [", tokens, ", K], got ", topk_ids.sizes(), " and ",
                    topk_weights.sizes());
  TORCH_CHECK_VALUE(w_gate_up.dim() == 3 && w_gate_up.size(2) == hidden && w_gate_up.size(1) % 2 == 0, op,
                    ": w_gate_up must be [E, 2*I, ", hidden, "], got ", w_gate_up.sizes());
  const int64_t num_local = w_gate_up.size(0), inter = w_gate_up.size(1) / 2, top_k = topk_ids.size(1);
  TORCH_CHECK_VALUE(w_down.dim() == 3 && w_down.size(0) == num_local && w_down.size(1) == hidden &&
                        w_down.size(2) == inter,
                    op, ": w_down must be [", num_local, ", ", hidden, ", ", inter, "], got ", w_down.sizes());
  const Ints ids = ints(topk_ids, op, "topk_ids");
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> local(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - expert_offset;
    local[p] = 0 <= e && e < num_local ? e : -1;
  }
  std::vector<float> xf(static_cast<size_t>(tokens * hidden)), wf(static_cast<size_t>(pairs));
  const at::Tensor xc = x.contiguous(), twc = topk_weights.contiguous();
  dispatch_float(x.scalar_type(), [&](auto t) { copy_to_f32<decltype(t)>(xc, xf.data()); });
  dispatch_float(topk_weights.scalar_type(), [&](auto t) { copy_to_f32<decltype(t)>(twc, wf.data()); });
  const at::Tensor gu = w_gate_up.contiguous(), dn = w_down.contiguous();
  const bool fp32_out = x.scalar_type() == c10::ScalarType::Float;
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  std::vector<float> out_f(fp32_out ? 0 : static_cast<size_t>(tokens * hidden));
  const MoeArgs args{xf.data(), wf.data(), local.data(), gu.data_ptr(), dn.data_ptr(),
                     fp32_out ? out.data_ptr<float>() : out_f.data(), tokens, top_k, hidden, inter, num_local};
  dispatch_float(w_gate_up.scalar_type(), [&](auto w) { run_experts<decltype(w)>(args); });
  if (!fp32_out)
    dispatch_float(x.scalar_type(), [&](auto t) {
      using T = decltype(t);
      T* dst = static_cast<T*>(out.data_ptr());
      for (int64_t i = 0; i < tokens * hidden; ++i) dst[i] = from_f32<T>(out_f[i]);
    });
  return out;
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const at::Tensor& w_gate_up, const at::Tensor& w_down, int64_t num_experts, int64_t ep_size,
                           int64_t tp_size, int64_t tp_rank) {
  if (ep_size > 1 || tp_size > 1) {  // the MPI exchange (Python); its local compute comes back to the kernel above
    static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("mtp::moe_experts_exchange", "");
    TORCH_CHECK_VALUE(handle.hasKernelForDispatchKey(c10::DispatchKey::CPU),
                      "moe_experts: ep_size > 1 or tp_size > 1 needs the MPI exchange; import plugins.ops (it registers "
                      "plugins/moe_ep.py's mtp::moe_experts_exchange)");
    static const auto exchange = handle.typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                                         int64_t, int64_t)>();
    return exchange.call(x, topk_ids, topk_weights, w_gate_up, w_down, num_experts, ep_size, tp_size, tp_rank);
  }
  return moe_experts_local_cpu(x, topk_ids, topk_weights, w_gate_up, w_down, 0);
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) {
  m.impl("moe_experts", &mtp::moe_experts_cpu);
  m.impl("moe_experts_local", &mtp::moe_experts_local_cpu);
}
