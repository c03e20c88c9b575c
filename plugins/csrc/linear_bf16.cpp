// mtp::linear_bf16 on CPU: y = x @ W^T + b for fp32 activations x [..., K] and a bf16 weight W [N, K]
// (nn.Linear's layout, row-major), reading the weight as bf16 and doing fp32 math in registers. bf16 -> fp32 is
// a 16-bit shift, so this is exactly the fp32 linear of the upcast weight up to summation order; the compiled
// engine's bf16-stored weights (builder/compile_aoti.py) call it instead of upcasting every weight per step.
//
// Few rows (M < kTiledRows: decode, verify, draft): each weight row is a dot product with every activation row.
// A tile of NR weight rows x MR activation rows keeps MR * NR fp32 accumulators in registers; all m-tiles of one
// weight-row block run back to back, so the block (NR * K * 2 bytes, L1-sized) comes from DRAM once and is
// re-read from L1 by the next m-tile: the weight is streamed once whatever M is. Each (row, output) dot runs the
// same lane-wise FMAs and the same horizontal sum whatever MR / NR is, so a row's result does not depend on the
// rest of the batch below kTiledRows. The [N, K] layout: one sequential stream per weight row, no panel to pack
// (a packed [K, N] panel layout was not measured; docs/PERFORMANCE.md "Compiled engine" has what was).
// Many rows (prefill chunks): compute-bound; a block of weight rows is converted into a reused fp32 tile and
// multiplied by at::mm / at::addmm (MKL), so the cost is MKL's plus one conversion of each weight per call.
//
// Paths: AVX-512 (16 lanes), AVX2 + FMA (8 lanes; AMD Zen 2/3 has no AVX-512) and the portable C++ body,
// chosen at run time by active_isa(). No vdpbf16ps: it would round the activations to bf16.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "dequant_mm.h"

namespace mtp {
namespace {

constexpr int64_t kTiledRows = 16;  // from this many rows on, the converted-tile at::mm path (compute-bound)
// Software prefetch distance along each weight row (elements): the few-row path streams NR rows at once, more
// streams than the hardware prefetcher follows far enough ahead on its own for DRAM-cold weights.
constexpr int64_t kPrefetch = 1024;

struct Gemv {
  const float* x;      // [M, K] fp32, contiguous
  const uint16_t* w;   // [N, K] bf16 bits, contiguous
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N] fp32
  int64_t m, n, k;
};

MTP_INLINE float bf16_to_f32(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- portable body: 8 partial sums per dot (the same order as Generic::dot) --------------------------------
void rows_generic(const Gemv& g, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = g.w + n * g.k;
    for (int64_t m = 0; m < g.m; ++m) {  // the weight row stays in L1 across the activation rows
      const float* x = g.x + m * g.k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= g.k; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[i + l] * bf16_to_f32(w[i + l]);
      float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < g.k; ++i) s += x[i] * bf16_to_f32(w[i]);
      g.y[m * g.n + n] = g.bias ? s + g.bias[n] : s;
    }
  }
}

// ---- AVX2 + FMA ----------------------------------------------------------------------------------------------

MTP_AVX2_TARGET inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

MTP_AVX2_TARGET inline float hsum8(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7)): fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r * NR + j] = x[r] . w[j] for MR activation rows and NR weight rows (w rows k apart)
template <int MR, int NR>
MTP_AVX2_TARGET inline void tile_avx2(const float* const* x, const uint16_t* w, int64_t k, float* out) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  auto step = [&](int64_t i) MTP_AVX2_TARGET {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * k + i);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {  // one 64-byte line of each weight row; prefetch kPrefetch ahead of it
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kPrefetch), _MM_HINT_T0);
    for (int u = 0; u < 32; u += 8) step(i + u);
  }
  for (; i + 8 <= k; i += 8) step(i);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float s = hsum8(acc[r][j]);
      for (int64_t t = i; t < k; ++t) s += x[r][t] * bf16_to_f32(w[j * k + t]);
      out[r * NR + j] = s;
    }
}

// ---- AVX-512 -------------------------------------------------------------------------------------------------
MTP_AVX512_TARGET inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

template <int MR, int NR>
MTP_AVX512_TARGET inline void tile_avx512(const float* const* x, const uint16_t* w, int64_t k, float* out) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    if (i % 32 == 0)  // one 64-byte line of each weight row per two steps
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kPrefetch), _MM_HINT_T0);
    const __mmask16 m = k - i >= 16 ? static_cast<__mmask16>(0xffff) : Avx512::tail(k - i);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load16(w + j * k + i, m);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float sums[4];
    static_assert(NR == 1 || NR == 4, "reduce4 takes 4 accumulators");
    const __m512 z = _mm512_setzero_ps();
    if constexpr (NR == 4) Avx512::reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
    else Avx512::reduce4(acc[r][0], z, z, z, sums);
    for (int q = 0; q < NR; ++q) out[r * NR + q] = sums[q];
  }
}

struct Avx2Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const uint16_t* w, int64_t k, float* out) {
    tile_avx2<MR, NR>(x, w, k, out);
  }
};
struct Avx512Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const uint16_t* w, int64_t k, float* out) {
    tile_avx512<MR, NR>(x, w, k, out);
  }
};

// One block of NR weight rows at feature n against all activation rows, in tiles of up to MR rows.
template <class Tile, int MR, int NR>
MTP_INLINE void block(const Gemv& g, int64_t n) {
  float out[MR * NR];
  const float* xs[MR];
  const uint16_t* w = g.w + n * g.k;
  for (int64_t m = 0; m < g.m; m += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, g.m - m));
    for (int r = 0; r < mr; ++r) xs[r] = g.x + (m + r) * g.k;
    switch (mr) {
      case 4: if constexpr (MR >= 4) Tile::template run<4, NR>(xs, w, g.k, out); break;
      case 3: if constexpr (MR >= 3) Tile::template run<3, NR>(xs, w, g.k, out); break;
      case 2: if constexpr (MR >= 2) Tile::template run<2, NR>(xs, w, g.k, out); break;
      default: Tile::template run<1, NR>(xs, w, g.k, out); break;
    }
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) {
        const float v = out[r * NR + j];
        g.y[(m + r) * g.n + n + j] = g.bias ? v + g.bias[n + j] : v;
      }
  }
}

// Weight rows [n0, n1): blocks of NR rows, then single rows.
template <class Tile, int MR, int NR>
MTP_INLINE void rows_tiled(const Gemv& g, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) block<Tile, MR, NR>(g, n);
  for (; n < n1; ++n) block<Tile, MR, 1>(g, n);
}

MTP_AVX2_TARGET __attribute__((flatten)) void rows_avx2(const Gemv& g, int64_t n0, int64_t n1) {
  // 16 ymm registers: 4 weight rows x 1-2 activation rows, or 2 x 4 (accumulators + weights + one x)
  if (g.m <= 2) rows_tiled<Avx2Tile, 2, 4>(g, n0, n1);
  else rows_tiled<Avx2Tile, 4, 2>(g, n0, n1);
}

MTP_AVX512_TARGET __attribute__((flatten)) void rows_avx512(const Gemv& g, int64_t n0, int64_t n1) {
  rows_tiled<Avx512Tile, 4, 4>(g, n0, n1);  // 32 zmm registers: 16 accumulators + 4 weights + one x
}

MTP_AVX512_TARGET __attribute__((flatten)) void widen_avx512(const uint16_t* src, float* dst, int64_t n) {
  Avx512::to_f32(reinterpret_cast<const c10::BFloat16*>(src), dst, n);
}

MTP_AVX2_TARGET __attribute__((flatten)) void widen_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

void rows(const Gemv& g, int64_t n0, int64_t n1) {
  switch (active_isa()) {
    case Isa::avx512: rows_avx512(g, n0, n1); break;
    case Isa::avx2: rows_avx2(g, n0, n1); break;
    default: rows_generic(g, n0, n1); break;
  }
}

// bf16 rows -> fp32 (exact), for the tiled path's weight tile
void widen(const uint16_t* src, float* dst, int64_t n) {
  switch (active_isa()) {
    case Isa::avx512: widen_avx512(src, dst, n); break;
    case Isa::avx2: widen_avx2(src, dst, n); break;
    default: for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  }
}

at::Tensor linear_bf16_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "mtp::linear_bf16";
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), op, ": x and weight must be CPU tensors");
  TORCH_CHECK_VALUE(x.scalar_type() == c10::ScalarType::Float, op, ": x must be fp32, got ", x.scalar_type(),
                    " (cast the activations with .float())");
  TORCH_CHECK_VALUE(weight.scalar_type() == c10::ScalarType::BFloat16 && weight.dim() == 2, op,
                    ": weight must be a 2-D bf16 tensor [N, K], got ", weight.scalar_type(), " ", py_shape(weight),
                    " (F.linear serves other weights)");
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous [N, K] (stored row-major; call "
                    ".contiguous() once when building, not per call)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  return weight_only_linear(op, x, weight, n, k, bias, [&](const at::Tensor& xc, const at::Tensor& bc, at::Tensor& y2) {
    if (xc.size(0) >= kTiledRows) {
      dequant_tile_mm(xc, bc.defined() ? c10::optional<at::Tensor>(bc) : c10::nullopt, y2, n, k,
                      [&](int64_t n0, int64_t n1, float* dst) { widen(w + n0 * k, dst, (n1 - n0) * k); });
      return;
    }
    const Gemv g{xc.data_ptr<float>(), w, bc.defined() ? bc.data_ptr<float>() : nullptr, y2.data_ptr<float>(),
                 xc.size(0), n, k};
    // 64 output features per task: a multiple of every NR; one thread runs them all inline
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { rows(g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_bf16", &mtp::linear_bf16_cpu); }
