// Weight-row tiles: dot products of weight rows stored in some format with fp32 activation rows, the few-row path of
// every weight-only linear (linear_bf16, linear_fp8, linear_int8; linear_int4: Int4Weights and int4_rows, with a
// run-time group size) and of the quantized MoE experts (moe_experts).
// One body per purpose, written once over the vector traits of simd.h (S) and a weight format (Fmt, below): the vector
// tile (simd_body.inc `Vector::tile`, compiled per ISA), the portable tile and the dequantizing conversion for the
// at::mm path (here; int4: Vector::dequant_int4_row). A new format is a struct of a few loads and gets all of them on
// every ISA.
//
// A tile computes out[r * NR + j] = x[r] . dequant(w[j]) for MR activation rows and NR weight rows k apart, every
// weight rounded once as the reference (plugins/reference.py) rounds it, fp32 math. Accumulator lane l of (r, j) sums
// the columns i with i % W == l in column order, then S's fixed tree (S::hsum4 sums each accumulator alone), so a
// (row, output) value does not depend on MR, NR or the rest of the batch. A partial last chunk is one masked step
// (S::kMaskedTail: AVX-512) or a scalar tail in column order after the reduction (AVX2). The portable tile keeps 8
// partial sums per dot, ((0+1)+(2+3)) + ((4+5)+(6+7)), then the tail (Generic::dot's order).
//
// Why the portable ISA (Generic) has tiles of its own here (the `std::is_same_v<V, Generic>` cases) instead of being
// one more instance of the vector body over 8-lane traits: it was tried (issue 26, Deliver 4: simd::Portable, 8 fp32
// lanes in plain C++ with this file's order; the tiles and conversions of bf16 / FP8 / int8 / int4 on it were bit for
// bit the portable ones, 10,287 outputs of every linear and quantized MoE op on every ISA) and lost speed: baseline
// x86-64 has no 8-lane register, and GCC compiled the body over a struct of 8 floats 1.1-2.6x slower than these loops
// at one activation row (bf16 2.6x), over its generic vectors (vector_size(32)) still 1.42x at 4 rows (bf16) and 1.28x
// at one (int8) (2048 x 2048, 1 thread; FP8 and 4-row int8 were 2x faster). And the int4 tile cannot be the body's
// at all without changing its results: its lane l sums the columns i % 8 == l across the whole row, the body restarts
// at lane 0 on every group and sums a group's last < W columns apart, so they agree only for groups that are a
// multiple of 8 (any even group is allowed).
#pragma once

#include "common.h"

namespace mtp {

// ---- weight formats ------------------------------------------------------------------------------------------------
// Elem: the stored element. times(q, scale_at(s, j, i)): the fp32 weight q = w[i] of row j, scaled, as the reference
// rounds it (the portable paths and scalar tails; scale_at is the same for 8 columns from a multiple of 8). kScaled: the vector loads give q, to be multiplied by scale<S>(s, j, c0) (the scale of row j for columns
// c0 .. c0 + kCols - 1). kRowScales: s is one scale per weight row (quant_rows passes s + o), else one scale row for
// the whole block of rows (FP8's 128 x 128 blocks). kNanBytes: some bytes are NaN (FP8), which the vector tile scans.
struct Bf16Weights {  // bf16 bits: a 16-bit shift, exact
  using Elem = c10::BFloat16;
  static constexpr bool kScaled = false, kRowScales = false, kNanBytes = false;
  static constexpr int64_t kCols = std::numeric_limits<int64_t>::max();
  static MTP_INLINE float scale_at(const float*, int, int64_t) { return 1.0f; }
  static MTP_INLINE float times(Elem q, float) { return f32(q); }
  template <class S> static constexpr bool kPaired = false;
  template <class S> static MTP_INLINE typename S::F load(const Elem* p) { return S::load(p); }
  template <class S> static MTP_INLINE typename S::F load_n(const Elem* p, int64_t n) { return S::load_n(p, n); }
  template <class S> static MTP_INLINE typename S::F load_exact(const Elem* p) { return S::load(p); }
};

// float8_e4m3fn (common.h "float8_e4m3fn weights"): the vector loads give q * 2^-8 and the scale is s * 256;
// load_exact (the dequantizing conversion) turns NaN bytes into NaN lane by lane, the vector tiles scan each row
// for NaN bytes as they stream it (kNanBytes: simd_body.inc `line_start`) and make its outputs NaN instead. The portable
// paths read q from the table (NaN included).
struct Fp8Weights {
  using Elem = uint8_t;
  static constexpr bool kScaled = true, kRowScales = false, kNanBytes = true;
  static constexpr int64_t kCols = kFp8Block;
  static MTP_INLINE float scale_at(const float* s, int, int64_t i) { return s[i / kCols]; }
  static MTP_INLINE float times(Elem q, float s) { return e4m3_times(q, s); }
  template <class S> static MTP_INLINE typename S::F scale(const float* s, int, int64_t c0) {
    return S::set1(s[c0 / kCols] * 256.0f);
  }
  template <class S> static MTP_INLINE typename S::F load(const Elem* p) { return S::load_e4m3(p); }
  template <class S> static constexpr bool kPaired = S::kPairedE4m3;  // load2: 2W columns in one conversion
  template <class S> static MTP_INLINE void load2(const Elem* p, typename S::F& lo, typename S::F& hi) {
    S::load_e4m3_x2(p, lo, hi);
  }
  template <class S> static MTP_INLINE typename S::F load_n(const Elem* p, int64_t n) { return S::load_e4m3_n(p, n); }
  template <class S> static MTP_INLINE typename S::F load_exact(const Elem* p) { return S::load_e4m3_nan(p); }
};

// int8 with one fp32 scale per weight row (`mtp-build --quantize int8`, plugins/reference.py quantize_int8)
struct Int8Weights {
  using Elem = int8_t;
  static constexpr bool kScaled = true, kRowScales = true, kNanBytes = false;
  static constexpr int64_t kCols = std::numeric_limits<int64_t>::max();
  static MTP_INLINE float scale_at(const float* s, int j, int64_t) { return s[j]; }
  static MTP_INLINE float times(Elem q, float s) { return static_cast<float>(q) * s; }
  template <class S> static MTP_INLINE typename S::F scale(const float* s, int j, int64_t) { return S::set1(s[j]); }
  template <class S> static constexpr bool kPaired = false;
  template <class S> static MTP_INLINE typename S::F load(const Elem* p) { return S::load_i8(p); }
  template <class S> static MTP_INLINE typename S::F load_n(const Elem* p, int64_t n) { return S::load_i8_n(p, n); }
  template <class S> static MTP_INLINE typename S::F load_exact(const Elem* p) { return S::load_i8(p); }
};

// Group-wise int4 (`mtp-build --quantize int4`, plugins/reference.py quantize_int4): a row of k columns is k / 2 bytes
// (column 2i in the low nibble of byte i, two's complement) with one fp32 scale per `group` columns (k / group per
// row). The group is a run-time size, so int4 has tiles of its own (int4_rows below, Vector::tile_int4, for
// linear_int4 and the int4 MoE experts) over these loads: table<S>(s) once per group and row, then scaled<S> gives W
// columns' fp32(q) * s from W / 2 bytes (scaled_n: the first n, 0 after them; AVX-512 only, whose tiles take a
// group's tail as one masked step).
struct Int4Weights {
  using Elem = uint8_t;
  static MTP_INLINE float value(const Elem* row, int64_t i) {  // fp32 q of column i of a packed row
    const int b = row[i >> 1], v = (i & 1) ? (b >> 4) : (b & 15);
    return static_cast<float>(v >= 8 ? v - 16 : v);
  }
  template <class S> static MTP_INLINE typename S::F table(float s) { return S::i4_table(s); }
  template <class S> static MTP_INLINE typename S::F scaled(const Elem* p, const typename S::F& t) {
    return S::load_i4_scaled(p, t);
  }
  template <class S> static MTP_INLINE typename S::F scaled_n(const Elem* p, int64_t n, const typename S::F& t) {
    return S::load_i4_scaled_n(p, n, t);
  }
  template <class S> static constexpr bool kPaired = S::kPairedI4;  // scaled2: 2W columns in one unpack
  template <class S>
  static MTP_INLINE void scaled2(const Elem* p, const typename S::F& t, typename S::F& lo, typename S::F& hi) {
    S::load_i4_scaled_x2(p, t, lo, hi);
  }
  // 2W columns from W bytes as the even columns' and the odd columns' values (S::kEvenOddI4: AVX-512)
  template <class S>
  static MTP_INLINE void scaled_even_odd(const Elem* p, const typename S::F& t, typename S::F& even,
                                         typename S::F& odd) {
    S::load_i4_even_odd(p, t, even, odd);
  }
};

// ---- the tiles -----------------------------------------------------------------------------------------------------

// The portable tile: 8 partial sums per dot, then the tail
template <class Fmt, int MR, int NR>
inline void portable_tile(const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const typename Fmt::Elem* wj = w + j * k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8) {
        const float sc = Fmt::scale_at(s, j, i);  // 8 columns never straddle a 128-column FP8 block
        for (int l = 0; l < 8; ++l) acc[l] += x[r][i + l] * Fmt::times(wj[i + l], sc);
      }
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < k; ++i) sum += x[r][i] * Fmt::times(wj[i], Fmt::scale_at(s, j, i));
      out[r * NR + j] = sum;
    }
}

template <class V, class Fmt, int MR, int NR>
MTP_INLINE void run_tile(const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k, float* out) {
  if constexpr (std::is_same_v<V, Generic>) portable_tile<Fmt, MR, NR>(x, w, s, k, out);
  else V::template tile<Fmt, MR, NR>(x, w, s, k, out);
}

// NR weight rows at w (rows o .. o + NR - 1 of the caller's block) against m activation rows, MR at a time:
// out[r][o + j] = x[r] . dequant(w[j]), NaN for a weight row holding a NaN byte. s: as Fmt takes it.
template <class V, class Fmt, int MR, int NR>
MTP_INLINE void quant_block(int64_t m, const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t k,
                            float* const* out, int64_t o) {
  float res[MR * NR];
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
      for (int j = 0; j < NR; ++j) out[m0 + r][o + j] = res[r * NR + j];
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
// x), and 8 weight rows at one activation row (decode: 8 rows streamed at once, 8 accumulators + 8 weights (+ 8 row
// scales for int8); linear_int8 at 14336 x 4096, 1 thread: ~0.93x the 4-row tile's time) unless the rows are short
// (at most kShortRow bytes: the experts' down rows, 1408 columns; there the 4-row tile was 0.88x the 8-row one's time
// for moe_experts_fp8, int8 even); AVX2 (16 ymm): 4 weight rows x 1-2 activation rows, or 2 x 4; portable: one weight
// row against 4 rows. A value does not depend on the tile shape (the file's head), so neither does the choice.
constexpr int64_t kShortRow = 2048;
template <class V, class Fmt>
MTP_INLINE void tiled_rows(int64_t m, const float* const* x, const typename Fmt::Elem* w, const float* s, int64_t rows,
                           int64_t k, float* const* out) {
  if constexpr (std::is_same_v<V, Generic>) quant_rows<V, Fmt, 4, 1>(m, x, w, s, rows, k, out);
  else if constexpr (V::kRegisters >= 32) {
    if (m == 1 && k * static_cast<int64_t>(sizeof(typename Fmt::Elem)) > kShortRow)
      quant_rows<V, Fmt, 1, 8>(m, x, w, s, rows, k, out);
    else quant_rows<V, Fmt, 4, 4>(m, x, w, s, rows, k, out);
  } else if (m <= 2) quant_rows<V, Fmt, 2, 4>(m, x, w, s, rows, k, out);
  else quant_rows<V, Fmt, 4, 2>(m, x, w, s, rows, k, out);
}

// ---- int4 tiles: out[r][o] = x[r] . dequant(w[o]) for r < m activation rows and o < rows packed int4 rows (k / 2
// bytes apart; s: their scales, k / group apart). The portable tile: accumulator l sums the columns i with i % 8 == l
// in column order, then ((0+1)+(2+3)) + ((4+5)+(6+7)). A (row, output) value never depends on MR, NR or m.
template <int MR, int NR>
inline void int4_portable_tile(const float* const* x, const uint8_t* w, const float* s, int64_t k, int64_t group,
                               float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const uint8_t* wj = w + j * (k / 2);
      const float* sj = s + j * (k / group);
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t c0 = 0, g = 0; c0 < k; c0 += group, ++g)  // column order; no division per column
        for (int64_t i = c0; i < c0 + group; ++i) acc[i & 7] += x[r][i] * (Int4Weights::value(wj, i) * sj[g]);
      out[r * NR + j] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

template <class V, int MR, int NR, bool kEvenOdd>
MTP_INLINE void run_int4_tile(const float* const* x, const uint8_t* w, const float* s, int64_t k, int64_t group,
                              float* out) {
  if constexpr (std::is_same_v<V, Generic>) int4_portable_tile<MR, NR>(x, w, s, k, group, out);
  else V::template tile_int4<Int4Weights, MR, NR, kEvenOdd>(x, w, s, k, group, out);
}

template <class V, int MR, int NR, bool kEvenOdd>
MTP_INLINE void int4_block(int64_t m, const float* const* x, const uint8_t* w, const float* s, int64_t k, int64_t group,
                           float* const* out, int64_t o) {
  float res[MR * NR];
  for (int64_t m0 = 0; m0 < m; m0 += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, m - m0));
    const float* const* xs = x + m0;
    switch (mr) {
      case 4: if constexpr (MR >= 4) run_int4_tile<V, 4, NR, kEvenOdd>(xs, w, s, k, group, res); break;
      case 3: if constexpr (MR >= 3) run_int4_tile<V, 3, NR, kEvenOdd>(xs, w, s, k, group, res); break;
      case 2: if constexpr (MR >= 2) run_int4_tile<V, 2, NR, kEvenOdd>(xs, w, s, k, group, res); break;
      default: run_int4_tile<V, 1, NR, kEvenOdd>(xs, w, s, k, group, res); break;
    }
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) out[m0 + r][o + j] = res[r * NR + j];
  }
}

template <class V, int MR, int NR, bool kEvenOdd>
MTP_INLINE void int4_rows_as(int64_t m, const float* const* x, const uint8_t* w, const float* s, int64_t rows, int64_t k,
                             int64_t group, float* const* out) {
  int64_t o = 0;
  for (; o + NR <= rows; o += NR)
    int4_block<V, MR, NR, kEvenOdd>(m, x, w + o * (k / 2), s + o * (k / group), k, group, out, o);
  for (; o < rows; ++o) int4_block<V, MR, 1, kEvenOdd>(m, x, w + o * (k / 2), s + o * (k / group), k, group, out, o);
}

// int4_rows_as with tiled_rows' shapes (the registers of V). kEvenOdd: the tile's even / odd step where V has it
// (Vector::tile_int4; mtp::linear_int4 takes it, the MoE experts keep column order: their results stay as they were)
template <class V, bool kEvenOdd = false>
MTP_INLINE void int4_rows(int64_t m, const float* const* x, const uint8_t* w, const float* s, int64_t rows, int64_t k,
                          int64_t group, float* const* out) {
  if constexpr (std::is_same_v<V, Generic>) int4_rows_as<V, 4, 1, kEvenOdd>(m, x, w, s, rows, k, group, out);
  else if constexpr (V::kRegisters >= 32) int4_rows_as<V, 4, 4, kEvenOdd>(m, x, w, s, rows, k, group, out);
  else if (m <= 2) int4_rows_as<V, 2, 4, kEvenOdd>(m, x, w, s, rows, k, group, out);
  else int4_rows_as<V, 4, 2, kEvenOdd>(m, x, w, s, rows, k, group, out);
}

// ---- dequantization: rows [0, rows) of w (k wide) into dst as fp32, the values the reference computes (NaN bytes
// NaN), for the at::mm path of many activation rows. s: as Fmt takes it (FP8: the scale row of these rows).
template <class V, class Fmt>
MTP_INLINE void dequant_rows(const typename Fmt::Elem* w, const float* s, int64_t rows, int64_t k, float* dst) {
  for (int64_t o = 0; o < rows; ++o) {
    const typename Fmt::Elem* wo = w + o * k;
    const float* so = Fmt::kRowScales ? s + o : s;
    float* d = dst + o * k;
    if constexpr (std::is_same_v<V, Generic>) {
      for (int64_t i = 0; i < k; ++i) d[i] = Fmt::times(wo[i], Fmt::scale_at(so, 0, i));
    } else {
      V::template dequant_row<Fmt>(wo, so, k, d);
    }
  }
}

// The same for packed int4 rows (k / 2 bytes apart, s their scales, k / group apart): Vector::dequant_int4_row
template <class V>
MTP_INLINE void dequant_int4_rows(const uint8_t* w, const float* s, int64_t rows, int64_t k, int64_t group, float* dst) {
  for (int64_t o = 0; o < rows; ++o) {
    const uint8_t* wo = w + o * (k / 2);
    const float* so = s + o * (k / group);
    float* d = dst + o * k;
    if constexpr (std::is_same_v<V, Generic>) {
      for (int64_t c0 = 0, g = 0; c0 < k; c0 += group, ++g)
        for (int64_t i = c0; i < c0 + group; ++i) d[i] = Int4Weights::value(wo, i) * so[g];
    } else {
      V::template dequant_int4_row<Int4Weights>(wo, so, k, group, d);
    }
  }
}

}  // namespace mtp
