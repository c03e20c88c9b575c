// Weight-row tiles: dot products of weight rows stored in some format with fp32 activation rows, the few-row path of
// every weight-only linear (linear_bf16, linear_fp8, linear_int8) and of the quantized MoE experts (moe_experts).
// One body per purpose, written once over the vector traits of simd.h (S) and a weight format (Fmt, below): a new
// format is a struct of four loads, and gets the vector tile on every ISA, the portable tile and the dequantizing
// conversion for the at::mm path.
//
// A tile computes out[r * NR + j] = x[r] . dequant(w[j]) for MR activation rows and NR weight rows k apart, every
// weight rounded once as the reference (plugins/reference.py) rounds it, fp32 math. Accumulator lane l of (r, j) sums
// the columns i with i % W == l in column order, then S's fixed tree (S::hsum), so a (row, output) value does not
// depend on MR, NR or the rest of the batch. A partial last chunk is one masked step (S::kMaskedTail: AVX-512) or a
// scalar tail in column order after the reduction (AVX2). The portable tile keeps 8 partial sums per dot,
// ((0+1)+(2+3)) + ((4+5)+(6+7)), then the tail (Generic::dot's order).
#pragma once

#include "common.h"

namespace mtp {

// ---- weight formats ------------------------------------------------------------------------------------------------
// Elem: the stored element. value(w, i, s, j): the fp32 weight w[i] of row j, scaled (the portable paths and scalar
// tails). kScaled: the vector loads give q, to be multiplied by scale<S>(s, j, c0) (the scale of row j for columns
// c0 .. c0 + kCols - 1). kRowScales: s is one scale per weight row (quant_rows passes s + o), else one scale row for
// the whole block of rows (FP8's 128 x 128 blocks).
struct Bf16Weights {  // bf16 bits: a 16-bit shift, exact
  using Elem = c10::BFloat16;
  static constexpr bool kScaled = false, kRowScales = false;
  static constexpr int64_t kCols = std::numeric_limits<int64_t>::max();
  static MTP_INLINE float value(const Elem* w, int64_t i, const float*, int) { return f32(w[i]); }
  template <class S> static MTP_INLINE typename S::F load(const Elem* p) { return S::load(p); }
  template <class S> static MTP_INLINE typename S::F load_n(const Elem* p, int64_t n) { return S::load_n(p, n); }
  template <class S> static MTP_INLINE typename S::F load_exact(const Elem* p) { return S::load(p); }
  template <class S> static MTP_INLINE bool has_nan(const Elem*, int64_t) { return false; }
};

// float8_e4m3fn (common.h "float8_e4m3fn weights"): the vector loads give q * 2^-8 and the scale is s * 256;
// load_exact (the dequantizing conversion) turns NaN bytes into NaN lane by lane, the tiles scan each row once
// (has_nan) and make its outputs NaN instead. The portable paths read q from the table (NaN included).
struct Fp8Weights {
  using Elem = uint8_t;
  static constexpr bool kScaled = true, kRowScales = false;
  static constexpr int64_t kCols = kFp8Block;
  static MTP_INLINE float value(const Elem* w, int64_t i, const float* s, int) { return e4m3_times(w[i], s[i / kCols]); }
  template <class S> static MTP_INLINE typename S::F scale(const float* s, int, int64_t c0) {
    return S::set1(s[c0 / kCols] * 256.0f);
  }
  template <class S> static MTP_INLINE typename S::F load(const Elem* p) { return S::load_e4m3(p); }
  template <class S> static MTP_INLINE typename S::F load_n(const Elem* p, int64_t n) { return S::load_e4m3_n(p, n); }
  template <class S> static MTP_INLINE typename S::F load_exact(const Elem* p) { return S::load_e4m3_nan(p); }
  template <class S> static MTP_INLINE bool has_nan(const Elem* w, int64_t k) {
    if constexpr (std::is_same_v<S, Generic>) return false;  // the table gives NaN itself
    else return S::e4m3_has_nan(w, k);
  }
};

// int8 with one fp32 scale per weight row (`mtp-build --quantize int8`, plugins/reference.py quantize_int8)
struct Int8Weights {
  using Elem = int8_t;
  static constexpr bool kScaled = true, kRowScales = true;
  static constexpr int64_t kCols = std::numeric_limits<int64_t>::max();
  static MTP_INLINE float value(const Elem* w, int64_t i, const float* s, int j) {
    return static_cast<float>(w[i]) * s[j];
  }
  template <class S> static MTP_INLINE typename S::F scale(const float* s, int j, int64_t) { return S::set1(s[j]); }
  template <class S> static MTP_INLINE typename S::F load(const Elem* p) { return S::load_i8(p); }
  template <class S> static MTP_INLINE typename S::F load_n(const Elem* p, int64_t n) { return S::load_i8_n(p, n); }
  template <class S> static MTP_INLINE typename S::F load_exact(const Elem* p) { return S::load_i8(p); }
  template <class S> static MTP_INLINE bool has_nan(const Elem*, int64_t) { return false; }
};

// ---- the tiles -----------------------------------------------------------------------------------------------------
constexpr int64_t kTilePrefetch = 2048;  // software prefetch distance along each weight row (bytes), 2 KB ahead

// One W-column step of a tile: masked (the last partial chunk, n columns; AVX-512) or not. (A function, not a lambda in
// vector_tile: GCC's flatten did not inline simd.h's members through a generic lambda.)
template <class S, class Fmt, int MR, int NR, bool kMasked>
MTP_INLINE void tile_step(typename S::F (&acc)[MR][NR], const float* const* x, const typename Fmt::Elem* w, int64_t k,
                          int64_t i, const typename S::F* sv, int64_t n) {
  using F = typename S::F;
  F wv[NR];
  for (int j = 0; j < NR; ++j) {
    if constexpr (kMasked) {
      const F q = Fmt::template load_n<S>(w + j * k + i, n);
      if constexpr (Fmt::kScaled) wv[j] = S::mul_n(q, sv[j], n);  // masked-off lanes 0, not 0 * s
      else wv[j] = q;
    } else {
      const F q = Fmt::template load<S>(w + j * k + i);
      if constexpr (Fmt::kScaled) wv[j] = S::mul(q, sv[j]);
      else wv[j] = q;
    }
  }
  for (int r = 0; r < MR; ++r) {
    F xv;
    if constexpr (kMasked) xv = S::load_n(x[r] + i, n);
    else xv = S::load(x[r] + i);
    for (int j = 0; j < NR; ++j) acc[r][j] = S::fma(xv, wv[j], acc[r][j]);
  }
}

// The vector tile: NR weight rows w (k apart; s as Fmt takes it) against MR activation rows x.
template <class S, class Fmt, int MR, int NR>
MTP_INLINE void vector_tile(const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k,
                            float* out) {
  using F = typename S::F;
  constexpr int W = S::W;
  constexpr int64_t kLine = 64 / sizeof(typename Fmt::Elem);  // elements per cache line of a weight row
  F acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = S::zero();
  int64_t i = 0;
  for (int64_t c0 = 0; c0 < k; c0 += std::min(k, Fmt::kCols)) {  // the columns of one scale (all of them, unscaled)
    const int64_t end = std::min(k - c0, Fmt::kCols) + c0;
    F sv[NR];
    if constexpr (Fmt::kScaled)
      for (int j = 0; j < NR; ++j) sv[j] = Fmt::template scale<S>(s, j, c0);
    for (i = c0; i + W <= end; i += W) {
      if (i % kLine == 0)
        for (int j = 0; j < NR; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i) + kTilePrefetch, _MM_HINT_T0);
      tile_step<S, Fmt, MR, NR, false>(acc, x, w, k, i, sv, W);
    }
    if constexpr (S::kMaskedTail)
      if (i < end) {
        tile_step<S, Fmt, MR, NR, true>(acc, x, w, k, i, sv, end - i);
        i = end;
      }
  }
  for (int r = 0; r < MR; ++r) {
    float sums[NR];
    S::template hsum<NR>(acc[r], sums);
    for (int j = 0; j < NR; ++j) {
      float v = sums[j];
      for (int64_t t = i; t < k; ++t) v += x[r][t] * Fmt::value(w + j * k, t, s, j);  // AVX2: < W columns left
      out[r * NR + j] = v;
    }
  }
}

// The portable tile: 8 partial sums per dot, then the tail
template <class Fmt, int MR, int NR>
inline void portable_tile(const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const typename Fmt::Elem* wj = w + j * k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[r][i + l] * Fmt::value(wj, i + l, s, j);
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < k; ++i) sum += x[r][i] * Fmt::value(wj, i, s, j);
      out[r * NR + j] = sum;
    }
}

template <class V, class Fmt, int MR, int NR>
MTP_INLINE void run_tile(const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k, float* out) {
  if constexpr (std::is_same_v<V, Generic>) portable_tile<Fmt, MR, NR>(x, w, s, k, out);
  else vector_tile<V, Fmt, MR, NR>(x, w, s, k, out);
}

// NR weight rows at w (rows o .. o + NR - 1 of the caller's block) against m activation rows, MR at a time:
// out[r][o + j] = x[r] . dequant(w[j]), NaN for a weight row holding a NaN byte. s: as Fmt takes it.
template <class V, class Fmt, int MR, int NR>
MTP_INLINE void quant_block(int64_t m, const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k,
                            float* const* out, int64_t o) {
  float res[MR * NR];
  bool nan[NR];
  for (int j = 0; j < NR; ++j) nan[j] = Fmt::template has_nan<V>(w + j * k, k);
  for (int64_t m0 = 0; m0 < m; m0 += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, m - m0));
    const float* const* xs = x + m0;
    switch (mr) {
      case 4: if constexpr (MR >= 4) run_tile<V, Fmt, 4, NR>(xs, w, s, k, res); break;
      case 3: if constexpr (MR >= 3) run_tile<V, Fmt, 3, NR>(xs, w, s, k, res); break;
      case 2: if constexpr (MR >= 2) run_tile<V, Fmt, 2, NR>(xs, w, s, k, res); break;
      default: run_tile<V, Fmt, 1, NR>(xs, w, s, k, res); break;
    }
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) out[m0 + r][o + j] = nan[j] ? std::numeric_limits<float>::quiet_NaN() : res[r * NR + j];
  }
}

// out[r][o] = x[r] . dequant(w[o]) for r < m activation rows and o < rows weight rows (k elements apart): blocks of
// NR weight rows, then single rows. s: the FP8 scale row all these rows use, or (Fmt::kRowScales) one scale per row.
template <class V, class Fmt, int MR, int NR>
MTP_INLINE void quant_rows(int64_t m, const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t rows,
                           int64_t k, float* const* out) {
  int64_t o = 0;
  for (; o + NR <= rows; o += NR)
    quant_block<V, Fmt, MR, NR>(m, x, w + o * k, Fmt::kRowScales ? s + o : s, k, out, o);
  for (; o < rows; ++o) quant_block<V, Fmt, MR, 1>(m, x, w + o * k, Fmt::kRowScales ? s + o : s, k, out, o);
}

// quant_rows with the tile shape that fills V's registers: AVX-512 (32 zmm): 4 x 4 (16 accumulators + 4 weights + one
// x); AVX2 (16 ymm): 4 weight rows x 1-2 activation rows, or 2 x 4; portable: one weight row against 4 rows.
template <class V, class Fmt>
MTP_INLINE void tiled_rows(int64_t m, const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t rows,
                           int64_t k, float* const* out) {
  if constexpr (std::is_same_v<V, Generic>) quant_rows<V, Fmt, 4, 1>(m, x, w, s, rows, k, out);
  else if constexpr (V::kRegisters >= 32) quant_rows<V, Fmt, 4, 4>(m, x, w, s, rows, k, out);
  else if (m <= 2) quant_rows<V, Fmt, 2, 4>(m, x, w, s, rows, k, out);
  else quant_rows<V, Fmt, 4, 2>(m, x, w, s, rows, k, out);
}

// ---- dequantization: rows [0, rows) of w (k wide) into dst as fp32, the values the reference computes (NaN bytes
// NaN), for the at::mm path of many activation rows. s: as Fmt takes it (FP8: the scale row of these rows).
template <class V, class Fmt>
MTP_INLINE void dequant_rows(const typename Fmt::Elem* w, const float* s, int64_t rows, int64_t k, float* dst) {
  for (int64_t o = 0; o < rows; ++o) {
    const typename Fmt::Elem* wo = w + o * k;
    const float* so = Fmt::kRowScales ? s + o : s;
    float* d = dst + o * k;
    int64_t i = 0;
    if constexpr (!std::is_same_v<V, Generic>) {
      for (int64_t c0 = 0; c0 < k; c0 += std::min(k, Fmt::kCols)) {
        const int64_t end = std::min(k - c0, Fmt::kCols) + c0;
        typename V::F sv = V::set1(1.0f);
        if constexpr (Fmt::kScaled) sv = Fmt::template scale<V>(so, 0, c0);
        for (i = c0; i + V::W <= end; i += V::W) {
          const typename V::F q = Fmt::template load_exact<V>(wo + i);
          V::store(d + i, Fmt::kScaled ? V::mul(q, sv) : q);
        }
        for (; i < end; ++i) d[i] = Fmt::value(wo, i, so, 0);  // each value is exact: any tail order is
      }
    }
    for (; i < k; ++i) d[i] = Fmt::value(wo, i, so, 0);
  }
}

}  // namespace mtp
