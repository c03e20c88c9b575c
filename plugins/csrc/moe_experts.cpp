// mtp::moe_experts and mtp::moe_experts_local on CPU: the routed experts of each token, reading only the
// selected experts' weights, in place (no gather copy), fp32 math over fp32 / fp16 / bf16 weights.
//
// Pairs (token, slot) are grouped by local expert; each weight row of an expert is read once and dotted with
// up to 4 of its tokens at a time (AVX2: tiles of 4 weight rows x 2 tokens, common.h rows_dot). Each pair's expert output lands in its own fp32 row, and a token's output
// sums its slots in slot order, so a token's result never depends on the rest of the batch. Semantics:
// plugins/reference.py moe_experts_ref (experts outside [offset, offset + E_local) contribute 0).
// ep_size > 1 or tp_size > 1: moe_experts calls mtp::moe_experts_exchange (Python, mpi4py; plugins/moe_ep.py),
// whose per-rank compute is moe_experts_local again. No per-forward plan: grouping the pairs is one pass.
//
// mtp::moe_experts_fp8 is moe_experts_local over the FP8 releases' expert weights as released: e4m3 bytes with
// one fp32 scale per 128 x 128 block (gate and up each blocked on their own, as the per-expert tensors ship), read
// by common.h's FP8 tiles (converted in registers, each weight rounded once, fp32 math: exact up to summation
// order against plugins/reference.py moe_experts_fp8_ref). fp32 activations; the compiled engine's single-rank
// MoE (builder/compile_aoti.py).
//
// mtp::moe_experts_int8 is the same over `mtp-build --quantize int8`'s experts: int8 with one fp32 scale per output
// row of each expert (plugins/reference.py quantize_int8 per expert matrix), read by common.h's int8 tiles, the ones
// mtp::linear_int8 reads its weights with (1 byte per weight, each weight rounded once as the reference rounds it,
// fp32 math: exact up to summation order against moe_experts_int8_ref).
//
// mtp::moe_experts_int4 is the same over `mtp-build --quantize int4`'s experts: group-wise int4 (plugins/reference.py
// quantize_int4 per expert matrix: two values per byte, one fp32 scale per group_size input features of a row, the
// layout mtp::linear_int4 reads), read by tiles.h's int4 tiles (Int4Weights, int4_rows: each weight fp32(q) * its
// group's scale, rounded once, fp32 math: exact up to summation order against moe_experts_int4_ref). 0.5 + 4 / G
// bytes per weight: the routed experts are most of an MoE model's bytes, and decode reads each chosen one once.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "tiles.h"

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
  // FP8: [E, 2 * ceil(I/128), ceil(H/128)] (gate's block rows, then up's) and [E, ceil(H/128), ceil(I/128)];
  // int8: [E, 2I] and [E, H]; int4: [E, 2I, H/G] and [E, H, I/G]
  const float* s_gate_up = nullptr;
  const float* s_down = nullptr;
  int64_t group = 0;  // int4: input features per scale (G)
};

struct Fp8 {};   // the weight type of moe_experts_fp8: e4m3 bytes + block scales
struct Int8 {};  // the weight type of moe_experts_int8: int8 + one scale per output row
struct Int4 {};  // the weight type of moe_experts_int4: packed int4 + one scale per group of a row

// A weight type's stored element and its tiles.h format (the quantized types; a float type is its own element and is
// read by rows_dot)
template <class W> struct Quant { static constexpr bool kQuantized = false; using Elem = W; };
template <> struct Quant<Fp8> { static constexpr bool kQuantized = true; using Fmt = Fp8Weights; using Elem = uint8_t; };
template <> struct Quant<Int8> { static constexpr bool kQuantized = true; using Fmt = Int8Weights; using Elem = int8_t; };
template <> struct Quant<Int4> { static constexpr bool kQuantized = true; using Fmt = Int4Weights; using Elem = uint8_t; };
// stored elements per weight row of k columns (int4: two columns per byte)
template <class W> constexpr int64_t row_elems(int64_t k) { return std::is_same_v<W, Int4> ? k / 2 : k; }

MTP_INLINE int64_t blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// The scales of one expert matrix of `parts` parts of part_rows x cols each: FP8, each part's 128 x 128 blocks;
// int8, one per row; int4, cols / group per row.
template <class W>
MTP_INLINE int64_t expert_scales(int64_t parts, int64_t part_rows, int64_t cols, int64_t group) {
  if constexpr (std::is_same_v<W, Int4>) return parts * part_rows * (cols / group);
  return std::is_same_v<W, Int8> ? parts * part_rows : parts * blocks(part_rows) * blocks(cols);
}

// The output-row blocks the threads split an expert matrix into: 128 rows, the FP8 scale block (a block never
// straddles two scale rows, nor gate and up), and a multiple of every micro-kernel's tile of weight rows.
constexpr int64_t kRowBlock = kFp8Block;

// out[i][o] = x[i] . w[o] for nx <= 4 tokens and rows o in block j of part p (gate 0, up 1; down has one part) of
// one expert matrix [parts * part_rows, k] (s: that matrix's scales): out[i] points at the pair's row of the whole
// matrix's outputs. FP8: the parts are blocked on their own (as the per-expert tensors ship): block j of part p uses
// scale row s[p * blocks(part_rows) + j]; int8: row r its own s[r]; int4: row r its k / group scales. A value does not depend on nx or on which rows
// share its block (common.h: rows_dot and the quantized tiles compute every (token, weight row) dot alone).
template <class V, class W>
MTP_INLINE void expert_block(int nx, const float* const* x, const typename Quant<W>::Elem* w, const float* s,
                             int64_t part_rows, int p, int64_t j, int64_t k, int64_t group, float* const* out) {
  const int64_t r0 = p * part_rows + j * kRowBlock, n = std::min(kRowBlock, part_rows - j * kRowBlock);
  float* shifted[4];
  for (int i = 0; i < nx; ++i) shifted[i] = out[i] + r0;
  if constexpr (std::is_same_v<W, Int4>) {
    int4_rows<V>(nx, x, w + r0 * (k / 2), s + r0 * (k / group), n, k, group, shifted);
  } else if constexpr (Quant<W>::kQuantized) {
    using Fmt = typename Quant<W>::Fmt;  // the register tiles linear_fp8 / linear_int8 use for this ISA
    const float* srow = Fmt::kRowScales ? s + r0 : s + (p * blocks(part_rows) + j) * blocks(k);
    tiled_rows<V, Fmt>(nx, x, w + r0 * k, srow, n, k, shifted);
  } else {
    rows_dot<V>(nx, x, w + r0 * k, k, n, k, shifted);
  }
}

// The shared state of one call, built by the caller (experts() below) and read by the threads.
struct MoePlan {
  const int64_t* start;  // [E + 1]: the pairs of expert e are order[start[e] .. start[e + 1])
  const int64_t* order;  // pair indices (token * top_k + slot) grouped by expert, token order kept
  const int64_t* items;  // (expert, block) work items of the current phase: expert * blocks_per_expert + block
  float* gu;             // [pairs in order, 2I]: gate | up of each pair (row c of `order`)
  float* h;              // [pairs in order, I]: silu(gate) * up
  float* y;              // [pairs, H]: each pair's expert output (row p = token * top_k + slot)
};

// Phase 1, items i0 .. i1 - 1: block (part, j) of expert e's gate|up rows for all of e's pairs, 4 pairs at a time.
template <class V, class W>
void gate_up_items(const MoeArgs& a, const MoePlan& pl, int64_t i0, int64_t i1) {
  using Elem = typename Quant<W>::Elem;
  const int64_t two_i = 2 * a.inter, per_part = blocks(a.inter);
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t e = pl.items[it] / (2 * per_part), b = pl.items[it] % (2 * per_part);
    const Elem* w = static_cast<const Elem*>(a.w_gate_up) + e * two_i * row_elems<W>(a.hidden);
    const float* s = a.s_gate_up ? a.s_gate_up + e * expert_scales<W>(2, a.inter, a.hidden, a.group) : nullptr;
    for (int64_t c = pl.start[e]; c < pl.start[e + 1]; c += 4) {
      const int nx = static_cast<int>(std::min<int64_t>(4, pl.start[e + 1] - c));
      const float* xs[4];
      float* outs[4];
      for (int i = 0; i < nx; ++i) {
        xs[i] = a.x + (pl.order[c + i] / a.top_k) * a.hidden;
        outs[i] = pl.gu + (c + i) * two_i;
      }
      expert_block<V, W>(nx, xs, w, s, a.inter, static_cast<int>(b / per_part), b % per_part, a.hidden, a.group, outs);
    }
  }
}

// Phase 2, rows c0 .. c1 - 1 of `order`: h = silu(gate) * up
template <class V>
void silu_rows(const MoeArgs& a, const MoePlan& pl, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c)
    V::silu_mul(pl.gu + c * 2 * a.inter, pl.gu + c * 2 * a.inter + a.inter, pl.h + c * a.inter, a.inter);
}

// Phase 3, items i0 .. i1 - 1: block j of expert e's down rows (output features) for all of e's pairs.
template <class V, class W>
void down_items(const MoeArgs& a, const MoePlan& pl, int64_t i0, int64_t i1) {
  using Elem = typename Quant<W>::Elem;
  const int64_t per = blocks(a.hidden);
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t e = pl.items[it] / per, j = pl.items[it] % per;
    const Elem* w = static_cast<const Elem*>(a.w_down) + e * a.hidden * row_elems<W>(a.inter);
    const float* s = a.s_down ? a.s_down + e * expert_scales<W>(1, a.hidden, a.inter, a.group) : nullptr;
    for (int64_t c = pl.start[e]; c < pl.start[e + 1]; c += 4) {
      const int nx = static_cast<int>(std::min<int64_t>(4, pl.start[e + 1] - c));
      const float* hs[4];
      float* ys[4];
      for (int i = 0; i < nx; ++i) {
        hs[i] = pl.h + (c + i) * a.inter;
        ys[i] = pl.y + pl.order[c + i] * a.hidden;
      }
      expert_block<V, W>(nx, hs, w, s, a.hidden, 0, j, a.inter, a.group, ys);
    }
  }
}

// Phase 4, tokens t0 .. t1 - 1: a token's output sums its slots in slot order
template <class V>
void combine_tokens(const MoeArgs& a, const MoePlan& pl, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    float* dst = a.out + t * a.hidden;
    std::fill(dst, dst + a.hidden, 0.0f);
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int64_t p = t * a.top_k + k;
      if (a.experts[p] >= 0) V::axpy(a.weights[p], pl.y + p * a.hidden, dst, a.hidden);
    }
  }
}

// ISA kernels of their own, not lambdas inside one: an at::parallel_for body runs through OpenMP's outlined
// function, so it would not be compiled for the ISA of the function that contains it.
MTP_ISA_KERNEL(run_gate_up_items, gate_up_items)
MTP_ISA_KERNEL(run_silu_rows, silu_rows)
MTP_ISA_KERNEL(run_down_items, down_items)
MTP_ISA_KERNEL(run_combine_tokens, combine_tokens)

// Threads: four at::parallel_for phases over independent outputs: (expert, 128-row block of gate|up) items, the
// SiLU rows, (expert, 128-row block of down's output features) items, then tokens. Splitting every expert's output
// features (not its pairs) gives a decode step as many items as its experts have blocks, and each weight byte is
// read by one thread once per call. Every value is computed by one item by the same operations whatever the thread
// count (a (token, weight row) dot alone; a token's slots summed in slot order by one thread), so the results are
// bit-identical for any thread count and batch. Grains from the work (common.h grain_for): a small call runs inline.
// `portable` runs the Generic body whatever the ISA (FP8 scales too large for the vector conversion).
template <class W>
void experts(const MoeArgs& a, bool portable) {
  const int64_t pairs = a.tokens * a.top_k, two_i = 2 * a.inter;
  // pairs grouped by expert (counting sort; token order kept within one expert)
  std::vector<int64_t> start(static_cast<size_t>(a.num_local + 1), 0), order(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p)
    if (a.experts[p] >= 0) ++start[a.experts[p] + 1];
  for (int64_t e = 0; e < a.num_local; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p)
      if (a.experts[p] >= 0) order[fill[a.experts[p]]++] = p;
  }
  const int64_t routed = start[a.num_local];
  // caller-owned buffers shared with the threads: scratch slots 3..5, which no parallel body takes (common.h)
  MoePlan pl{start.data(), order.data(), nullptr, scratch(3, routed * two_i), scratch(4, routed * a.inter),
             scratch(5, pairs * a.hidden)};
  std::vector<int64_t> items;
  auto phase_items = [&](int64_t per_expert) {
    items.clear();
    for (int64_t e = 0; e < a.num_local; ++e)
      if (start[e + 1] > start[e])
        for (int64_t b = 0; b < per_expert; ++b) items.push_back(e * per_expert + b);
    pl.items = items.data();
    return static_cast<int64_t>(items.size());
  };
  auto go = [&](int64_t n, int64_t work, auto&& body) {
    if (n > 0) at::parallel_for(0, n, grain_for(n, work), body);
  };
  int64_t n = phase_items(2 * blocks(a.inter));
  go(n, routed * two_i * a.hidden, [&](int64_t i0, int64_t i1) {
    if (portable) gate_up_items<Generic, W>(a, pl, i0, i1);
    else run_gate_up_items<W>(a, pl, i0, i1);
  });
  go(routed, routed * a.inter * 8, [&](int64_t c0, int64_t c1) {  // ~8 flops per SiLU value
    if (portable) silu_rows<Generic>(a, pl, c0, c1);
    else run_silu_rows(a, pl, c0, c1);
  });
  n = phase_items(blocks(a.hidden));
  go(n, routed * a.hidden * a.inter, [&](int64_t i0, int64_t i1) {
    if (portable) down_items<Generic, W>(a, pl, i0, i1);
    else run_down_items<W>(a, pl, i0, i1);
  });
  go(a.tokens, pairs * a.hidden, [&](int64_t t0, int64_t t1) {
    if (portable) combine_tokens<Generic>(a, pl, t0, t1);
    else run_combine_tokens(a, pl, t0, t1);
  });
}

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
  dispatch_float(w_gate_up.scalar_type(), [&](auto w) { experts<decltype(w)>(args, false); });
  if (!fp32_out)
    dispatch_float(x.scalar_type(), [&](auto t) {
      using T = decltype(t);
      T* dst = static_cast<T*>(out.data_ptr());
      for (int64_t i = 0; i < tokens * hidden; ++i) dst[i] = from_f32<T>(out_f[i]);
    });
  return out;
}

// What moe_experts_fp8, _int8 and _int4 share: the checks of x, the routing and the two weights' shapes (their dtype
// must pass `dtype_ok`, else `dtype_error`), then the call (fp32 out) over the weights' checked scales. group: int4's.
template <class W>
at::Tensor quantized_experts(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const at::Tensor& w_gate_up,
                             const at::Tensor& w_gate_up_scale, const at::Tensor& w_down,
                             const at::Tensor& w_down_scale, int64_t expert_offset, bool dtype_ok,
                             const char* dtype_error, int64_t group = 0) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == c10::ScalarType::Float && x.dim() == 2, op,
                    ": x must be an fp32 CPU tensor [T, H], got ", x.scalar_type(), " ", py_shape(x));
  check_float(topk_weights, op, "topk_weights");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(), op,
                    ": topk_ids and topk_weights must be [", tokens, ", K], got ", py_shape(topk_ids), " and ",
                    py_shape(topk_weights));
  TORCH_CHECK_VALUE(dtype_ok, op, ": w_gate_up and w_down must both be ", dtype_error, ", got ",
                    w_gate_up.scalar_type(), " and ", w_down.scalar_type());
  // int4: a weight row of c columns is c / 2 bytes, with c / group scales
  const bool fp8 = std::is_same_v<W, Fp8>, int4 = std::is_same_v<W, Int4>;
  const int64_t pack = int4 ? 2 : 1;
  TORCH_CHECK_VALUE(!int4 || (group > 0 && group % 2 == 0 && hidden % group == 0), op, ": group_size must be a positive "
                    "even divisor of H = ", hidden, " (quantize_int4's group), got ", group);
  TORCH_CHECK_VALUE(w_gate_up.dim() == 3 && w_gate_up.size(2) * pack == hidden && w_gate_up.size(1) % 2 == 0 &&
                        w_gate_up.is_contiguous(),
                    op, ": w_gate_up must be contiguous [E, 2*I, ", hidden / pack, "], got ", py_shape(w_gate_up));
  const int64_t num_local = w_gate_up.size(0), inter = w_gate_up.size(1) / 2, top_k = topk_ids.size(1);
  TORCH_CHECK_VALUE(!int4 || inter % group == 0, op, ": I = ", inter, " (w_gate_up.size(1) / 2) is not a multiple of "
                    "group_size ", group, " (quantize the experts with a group size that divides H and I)");
  TORCH_CHECK_VALUE(w_down.dim() == 3 && w_down.size(0) == num_local && w_down.size(1) == hidden &&
                        w_down.size(2) * pack == inter && w_down.is_contiguous(),
                    op, ": w_down must be contiguous [", num_local, ", ", hidden, ", ", inter / pack, "], got ",
                    py_shape(w_down));
  const std::vector<int64_t> sgu = fp8    ? std::vector<int64_t>{num_local, 2 * blocks(inter), blocks(hidden)}
                                   : int4 ? std::vector<int64_t>{num_local, 2 * inter, hidden / std::max<int64_t>(group, 1)}
                                          : std::vector<int64_t>{num_local, 2 * inter};
  const std::vector<int64_t> sdn = fp8    ? std::vector<int64_t>{num_local, blocks(hidden), blocks(inter)}
                                   : int4 ? std::vector<int64_t>{num_local, hidden, inter / std::max<int64_t>(group, 1)}
                                          : std::vector<int64_t>{num_local, hidden};
  const char* per = int4 ? " (one per group_size input features of each row of " : " (one per row of ";
  TORCH_CHECK_VALUE(w_gate_up_scale.scalar_type() == c10::ScalarType::Float && w_gate_up_scale.sizes() == sgu, op,
                    ": w_gate_up_scale must be fp32 ", at::IntArrayRef(sgu),
                    fp8 ? " (gate's 128-row blocks, then up's, per expert)" : per, fp8 ? "" : "w_gate_up)", ", got ",
                    w_gate_up_scale.scalar_type(), " ", py_shape(w_gate_up_scale));
  TORCH_CHECK_VALUE(w_down_scale.scalar_type() == c10::ScalarType::Float && w_down_scale.sizes() == sdn, op,
                    ": w_down_scale must be fp32 ", at::IntArrayRef(sdn), fp8 ? "" : per, fp8 ? "" : "w_down)", ", got ",
                    w_down_scale.scalar_type(), " ", py_shape(w_down_scale));
  const Ints ids = ints(topk_ids, op, "topk_ids");
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> local(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - expert_offset;
    local[p] = 0 <= e && e < num_local ? e : -1;
  }
  std::vector<float> wf(static_cast<size_t>(pairs));
  const at::Tensor xc = x.contiguous(), twc = topk_weights.contiguous();
  dispatch_float(topk_weights.scalar_type(), [&](auto t) { copy_to_f32<decltype(t)>(twc, wf.data()); });
  const at::Tensor sg = w_gate_up_scale.contiguous(), sd = w_down_scale.contiguous();
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  MoeArgs args{xc.data_ptr<float>(), wf.data(), local.data(), w_gate_up.data_ptr(), w_down.data_ptr(),
               out.data_ptr<float>(), tokens, top_k, hidden, inter, num_local};
  args.s_gate_up = sg.data_ptr<float>();
  args.s_down = sd.data_ptr<float>();
  args.group = group;
  // FP8, a scale >= 2^120: the portable table path (see common.h); int8's and int4's tiles take any scale
  const bool portable = fp8 && !(fp8_scales_vector_safe(args.s_gate_up, sg.numel()) &&
                                 fp8_scales_vector_safe(args.s_down, sd.numel()));
  experts<W>(args, portable);
  return out;
}

at::Tensor moe_experts_fp8_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                               const at::Tensor& w_gate_up, const at::Tensor& w_gate_up_scale, const at::Tensor& w_down,
                               const at::Tensor& w_down_scale, int64_t expert_offset) {
  const auto dt = w_gate_up.scalar_type();
  const bool ok = (dt == c10::ScalarType::Float8_e4m3fn || dt == c10::ScalarType::Byte) && w_down.scalar_type() == dt;
  return quantized_experts<Fp8>("mtp::moe_experts_fp8", x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down,
                                w_down_scale, expert_offset, ok, "float8_e4m3fn (or uint8 bits)");
}

at::Tensor moe_experts_int8_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const at::Tensor& w_gate_up, const at::Tensor& w_gate_up_scale,
                                const at::Tensor& w_down, const at::Tensor& w_down_scale, int64_t expert_offset) {
  const bool ok = w_gate_up.scalar_type() == c10::ScalarType::Char && w_down.scalar_type() == c10::ScalarType::Char;
  return quantized_experts<Int8>("mtp::moe_experts_int8", x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale,
                                 w_down, w_down_scale, expert_offset, ok, "int8");
}

at::Tensor moe_experts_int4_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const at::Tensor& w_gate_up, const at::Tensor& w_gate_up_scale,
                                const at::Tensor& w_down, const at::Tensor& w_down_scale, int64_t group_size,
                                int64_t expert_offset) {
  const bool ok = w_gate_up.scalar_type() == c10::ScalarType::Byte && w_down.scalar_type() == c10::ScalarType::Byte;
  return quantized_experts<Int4>("mtp::moe_experts_int4", x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale,
                                 w_down, w_down_scale, expert_offset, ok, "uint8 (packed int4: quantize_int4)",
                                 group_size);
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
  m.impl("moe_experts_fp8", &mtp::moe_experts_fp8_cpu);
  m.impl("moe_experts_int8", &mtp::moe_experts_int8_cpu);
  m.impl("moe_experts_int4", &mtp::moe_experts_int4_cpu);
}
