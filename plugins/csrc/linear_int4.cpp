// mtp::linear_int4 on CPU: y = x @ dequant(W)^T + b for fp32 activations x [..., K] and a group-wise weight-only int4
// weight (plugins/reference.py quantize_int4 makes it): W packed [N, K/2] uint8, two's-complement 4-bit values, column
// 2i in the low nibble of byte i and column 2i + 1 in the high one; scale [N, K/G] fp32, one per G consecutive input
// features of a row; dequant(W)[n, k] = fp32(q[n, k]) * scale[n, k / G]. Half a byte per weight plus 4 / G bytes of
// scale (0.625 at G = 32): decode at real size reads the weight once per step, so it runs about that much faster
// than int8 where memory bandwidth bounds it. Each dequantized weight is rounded once, as linear_int4_ref rounds it,
// and the math is fp32: exact up to summation order.
//
// linear_int8.cpp's structure: few rows (M < kTiledRows: decode, verify, draft) run NR weight rows x MR activation
// rows in registers, every m-tile of a weight-row block back to back (each weight byte comes from DRAM once whatever M
// is); a row's result is computed by the same operations whatever the rest of the batch is (one accumulator per (row,
// output), one reduction tree), so a decode row equals the same row inside a verify. Many rows: dequant_mm.h (a
// dequantized fp32 tile times MKL). The weight is unpacked in registers (common.h int4x16_nibbles); AVX-512 maps the
// 16 nibble values to fp32(q) * scale with one permute from a per-group table (16 products, each the reference's
// rounding), AVX2 sign-extends them (a pshufb table) and multiplies.
//
// Paths: AVX-512, AVX2 + FMA, portable C++, chosen at run time by active_isa(). at::parallel_for over blocks of 64
// output features (grain_for: a small call stays inline). G is any even number dividing K (a group ends on a byte);
// the vector loops run per group, so K need not be a multiple of the vector width.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "dequant_mm.h"

namespace mtp {
namespace {

constexpr int64_t kTiledRows = 16;  // from this many rows on, the dequantized-tile at::mm path (as linear_int8)
// Software prefetch: a row is half int8's bytes (2048 at K = 4096), so int8's 2048 bytes ahead along the row lands in
// the next row of the same NR-row block, already being read. The kernels prefetch the same bytes of the next block
// instead (NR rows further): at M = 1, 1 thread, 4096 x 4096 went from 0.83x to 0.70x int8's time and 4096 x 10944
// from 0.98x to 0.79x (one run each, loaded 2-core VM; 4096 and 8192 bytes ahead along the row: 0.76-1.01x).

struct Gemv {
  const float* x;     // [M, K] fp32, contiguous
  const uint8_t* w;   // [N, K/2] packed int4, contiguous
  const float* s;     // [N, K/G] fp32, contiguous
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N] fp32
  int64_t m, n, k, group;
  int64_t row_bytes() const { return k / 2; }
  int64_t groups() const { return k / group; }
};

// the value of column i of a packed row
MTP_INLINE float int4_at(const uint8_t* w, int64_t i) {
  const int b = w[i >> 1];
  const int v = (i & 1) ? (b >> 4) : (b & 15);
  return static_cast<float>(v >= 8 ? v - 16 : v);
}

// ---- tiles: out[r * NR + j] = x[r] . dequant(w[j]) for MR activation rows and NR weight rows (g.row_bytes() apart,
// their scales g.groups() apart). A (row, output) value is computed by the same operations whatever MR and NR are.

// portable: accumulator l sums the columns i with i % 8 == l in column order, then (0+1)+(2+3) + (4+5)+(6+7)
template <int MR, int NR>
void int4_tile_generic(const Gemv& g, const float* const* x, const uint8_t* w, const float* s, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const uint8_t* wj = w + j * g.row_bytes();
      const float* sj = s + j * g.groups();
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < g.k; ++i) acc[i & 7] += x[r][i] * (int4_at(wj, i) * sj[i / g.group]);
      out[r * NR + j] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

// AVX2: per group, 16-column steps, then one 8-column step, then the group's last < 8 columns (scalar, in column
// order, into a second sum added after the vector one's fixed reduction)
template <int MR, int NR>
MTP_AVX2_TARGET inline void int4_tile_avx2(const Gemv& g, const float* const* x, const uint8_t* w, const float* s,
                                           float* out) {
  __m256 acc[MR][NR];
  float rest[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps(), rest[r][j] = 0.0f;
  const int64_t rb = g.row_bytes(), ng = g.groups();
  for (int64_t c0 = 0, grp = 0; c0 < g.k; c0 += g.group, ++grp) {
    const int64_t end = c0 + g.group;
    int64_t i = c0;
    for (; i + 16 <= end; i += 16) {
      if (i % 128 == 0)
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * rb + i / 2), _MM_HINT_T0);
      for (int j = 0; j < NR; ++j) {
        const __m128i q = int4x16_signed(int4x16_nibbles(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * rb + i / 2))));
        const __m256 sv = _mm256_set1_ps(s[j * ng + grp]);
        const __m256 lo = _mm256_mul_ps(int8x8_avx2(q), sv), hi = _mm256_mul_ps(int8x8_avx2(_mm_srli_si128(q, 8)), sv);
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), lo, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i + 8), hi, acc[r][j]);
        }
      }
    }
    if (i + 8 <= end) {
      for (int j = 0; j < NR; ++j) {
        int32_t four;
        std::memcpy(&four, w + j * rb + i / 2, 4);
        const __m128i q = int4x16_signed(int4x16_nibbles(_mm_cvtsi32_si128(four)));
        const __m256 wv = _mm256_mul_ps(int8x8_avx2(q), _mm256_set1_ps(s[j * ng + grp]));
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), wv, acc[r][j]);
      }
      i += 8;
    }
    for (; i < end; ++i)
      for (int j = 0; j < NR; ++j) {
        const float wv = int4_at(w + j * rb, i) * s[j * ng + grp];
        for (int r = 0; r < MR; ++r) rest[r][j] += x[r][i] * wv;
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) out[r * NR + j] = simd::Avx2::hsum8(acc[r][j]) + rest[r][j];
}

// fp32(q) for the nibbles 0..15 (two's complement): the per-group table the AVX-512 paths scale and permute
MTP_AVX512_TARGET inline __m512 int4_values_avx512() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
}

// 16 columns (the first lanes of m; masked-off lanes 0, not 0 * s) at packed byte p as fp32(q) * s: table = the
// group's int4_values_avx512() * s
MTP_AVX512_TARGET inline __m512 int4x16_avx512(const uint8_t* p, __mmask16 m, bool masked, __m512 table) {
  const __m128i bytes = masked ? _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (std::popcount(m) / 2)) - 1u), p)
                               : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m512i idx = _mm512_cvtepu8_epi32(int4x16_nibbles(bytes));
  return masked ? _mm512_maskz_permutexvar_ps(m, idx, table) : _mm512_permutexvar_ps(idx, table);
}

template <int MR, int NR>
MTP_AVX512_TARGET inline void int4_tile_avx512(const Gemv& g, const float* const* x, const uint8_t* w, const float* s,
                                               float* out) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t rb = g.row_bytes(), ng = g.groups();
  const __m512 values = int4_values_avx512();
  for (int64_t c0 = 0, grp = 0; c0 < g.k; c0 += g.group, ++grp) {
    __m512 table[NR];
    for (int j = 0; j < NR; ++j) table[j] = _mm512_mul_ps(values, _mm512_set1_ps(s[j * ng + grp]));
    const int64_t end = c0 + g.group;
    int64_t i = c0;
    // 32 columns (16 bytes) per weight row and step: the bytes widened to 16 int32 lanes are the permute indexes of
    // the even columns as they are (the permute reads the low 4 bits) and of the odd ones shifted by 4, so a weight
    // costs half an instruction; the activations are split into even and odd columns instead, once per step for all
    // NR weight rows.
    for (; i + 32 <= end; i += 32) {
      if (i % 128 == 0)  // the same bytes of the next block of NR rows (see kInt4Prefetch)
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * rb + i / 2), _MM_HINT_T0);
      __m512 even[NR], odd[NR];
      for (int j = 0; j < NR; ++j) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * rb + i / 2)));
        even[j] = _mm512_permutexvar_ps(b, table[j]);
        odd[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table[j]);
      }
      const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
      for (int r = 0; r < MR; ++r) {
        const __m512 x0 = _mm512_loadu_ps(x[r] + i), x1 = _mm512_loadu_ps(x[r] + i + 16);
        const __m512 xe = _mm512_permutex2var_ps(x0, even_idx, x1), xo = _mm512_permutex2var_ps(x0, odd_idx, x1);
        for (int j = 0; j < NR; ++j) {
          acc[r][j] = _mm512_fmadd_ps(xe, even[j], acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(xo, odd[j], acc[r][j]);
        }
      }
    }
    for (; i < end; i += 16) {
      const bool masked = end - i < 16;
      const __mmask16 m = masked ? Avx512::tail(end - i) : static_cast<__mmask16>(0xffff);
      if (i % 128 == 0)
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * rb + i / 2), _MM_HINT_T0);
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = int4x16_avx512(w + j * rb + i / 2, m, masked, table[j]);
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = masked ? _mm512_maskz_loadu_ps(m, x[r] + i) : _mm512_loadu_ps(x[r] + i);
        for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
      }
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

// ---- the few-row driver (common.h quant_rows' shape, with int4's row and scale strides) -----------------------
template <int MR, int NR, class Tile>
MTP_INLINE void int4_block(const Gemv& g, const float* const* xs, int64_t o, const Tile& tile) {
  float res[MR * NR];
  const uint8_t* w = g.w + o * g.row_bytes();
  const float* s = g.s + o * g.groups();
  for (int64_t m0 = 0; m0 < g.m; m0 += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, g.m - m0));
    switch (mr) {
      case 4: if constexpr (MR >= 4) tile.template operator()<4, NR>(g, xs + m0, w, s, res); break;
      case 3: if constexpr (MR >= 3) tile.template operator()<3, NR>(g, xs + m0, w, s, res); break;
      case 2: if constexpr (MR >= 2) tile.template operator()<2, NR>(g, xs + m0, w, s, res); break;
      default: tile.template operator()<1, NR>(g, xs + m0, w, s, res); break;
    }
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) g.y[(m0 + r) * g.n + o + j] = res[r * NR + j];
  }
}

// Weight rows [n0, n1) against the M (< kTiledRows) activation rows: blocks of NR rows, then single rows
template <int MR, int NR, class Tile>
MTP_INLINE void rows_with(const Gemv& g, int64_t n0, int64_t n1, const Tile& tile) {
  const float* xs[kTiledRows];
  for (int64_t r = 0; r < g.m; ++r) xs[r] = g.x + r * g.k;
  int64_t o = n0;
  for (; o + NR <= n1; o += NR) int4_block<MR, NR>(g, xs, o, tile);
  for (; o < n1; ++o) int4_block<MR, 1>(g, xs, o, tile);
  if (g.bias)
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t n = n0; n < n1; ++n) g.y[r * g.n + n] += g.bias[n];
}

struct GenericTile {
  template <int MR, int NR>
  MTP_INLINE void operator()(const Gemv& g, const float* const* x, const uint8_t* w, const float* s, float* out) const {
    int4_tile_generic<MR, NR>(g, x, w, s, out);
  }
};
struct Avx2Tile {
  template <int MR, int NR>
  MTP_INLINE void operator()(const Gemv& g, const float* const* x, const uint8_t* w, const float* s, float* out) const {
    int4_tile_avx2<MR, NR>(g, x, w, s, out);
  }
};
struct Avx512Tile {
  template <int MR, int NR>
  MTP_INLINE void operator()(const Gemv& g, const float* const* x, const uint8_t* w, const float* s, float* out) const {
    int4_tile_avx512<MR, NR>(g, x, w, s, out);
  }
};

void rows_generic(const Gemv& g, int64_t n0, int64_t n1) { rows_with<4, 1>(g, n0, n1, GenericTile{}); }

MTP_AVX2_TARGET __attribute__((flatten)) void rows_avx2(const Gemv& g, int64_t n0, int64_t n1) {
  // 16 ymm registers: accumulators MR x NR (8) + the two converted halves of one weight chunk + one x (linear_int8's)
  if (g.m <= 2) rows_with<2, 4>(g, n0, n1, Avx2Tile{});
  else rows_with<4, 2>(g, n0, n1, Avx2Tile{});
}

MTP_AVX512_TARGET __attribute__((flatten)) void rows_avx512(const Gemv& g, int64_t n0, int64_t n1) {
  rows_with<4, 4>(g, n0, n1, Avx512Tile{});  // 32 zmm registers: 16 accumulators + 4 weights + 4 tables + one x
}

void rows(Isa isa, const Gemv& g, int64_t n0, int64_t n1) {
  switch (isa) {
    case Isa::avx512: rows_avx512(g, n0, n1); break;
    case Isa::avx2: rows_avx2(g, n0, n1); break;
    default: rows_generic(g, n0, n1); break;
  }
}

// ---- dequantize rows [n0, n1) of W into dst (row-major, k wide): the fp32 values the reference computes --------
void dequant_generic(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = g.w + n * g.row_bytes();
    const float* s = g.s + n * g.groups();
    float* d = dst + (n - n0) * g.k;
    for (int64_t i = 0; i < g.k; ++i) d[i] = int4_at(w, i) * s[i / g.group];
  }
}

MTP_AVX512_TARGET __attribute__((flatten)) void dequant_avx512(const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  const __m512 values = int4_values_avx512();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = g.w + n * g.row_bytes();
    const float* s = g.s + n * g.groups();
    float* d = dst + (n - n0) * g.k;
    for (int64_t c0 = 0, grp = 0; c0 < g.k; c0 += g.group, ++grp) {
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(s[grp]));
      for (int64_t i = c0; i < c0 + g.group; i += 16) {
        const bool masked = c0 + g.group - i < 16;
        const __mmask16 m = masked ? Avx512::tail(c0 + g.group - i) : static_cast<__mmask16>(0xffff);
        _mm512_mask_storeu_ps(d + i, m, int4x16_avx512(w + i / 2, m, masked, table));
      }
    }
  }
}

void dequant(Isa isa, const Gemv& g, int64_t n0, int64_t n1, float* dst) {
  // AVX2 converts a tile with the portable loop: the tiled path is compute-bound in MKL, not in this conversion
  if (isa == Isa::avx512) dequant_avx512(g, n0, n1, dst);
  else dequant_generic(g, n0, n1, dst);
}

at::Tensor linear_int4_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t group_size,
                           const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "mtp::linear_int4";
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), op,
                    ": x, weight and scale must be CPU tensors");
  TORCH_CHECK_VALUE(x.scalar_type() == c10::ScalarType::Float, op, ": x must be fp32, got ", x.scalar_type(),
                    " (cast the activations with .float())");
  TORCH_CHECK_VALUE(weight.scalar_type() == c10::ScalarType::Byte && weight.dim() == 2, op,
                    ": weight must be a 2-D uint8 tensor [N, K/2] (two int4 per byte; plugins/reference.py "
                    "quantize_int4), got ", weight.scalar_type(), " ", py_shape(weight));
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous [N, K/2] (stored row-major; call "
                    ".contiguous() once when building, not per call)");
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 2 == 0, op, ": group_size must be a positive even number "
                    "(a group ends on a byte), got ", group_size);
  const int64_t n = weight.size(0), k = weight.size(1) * 2;
  TORCH_CHECK_VALUE(k % group_size == 0, op, ": K = ", k, " (2 * weight.size(1)) is not a multiple of group_size ",
                    group_size, " (quantize with a group size that divides K)");
  TORCH_CHECK_VALUE(scale.scalar_type() == c10::ScalarType::Float && scale.dim() == 2 && scale.size(0) == n &&
                        scale.size(1) == k / group_size,
                    op, ": scale must be fp32 [", n, ", ", k / group_size, "] (one per ", group_size,
                    " input features of each row of weight ", py_shape(weight), "), got ", scale.scalar_type(), " ",
                    py_shape(scale));
  const at::Tensor sc = scale.contiguous();
  return weight_only_linear(op, x, weight, n, k, bias, [&](const at::Tensor& xc, const at::Tensor& bc, at::Tensor& y2) {
    const Isa isa = active_isa();
    const Gemv g{xc.data_ptr<float>(), weight.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                 bc.defined() ? bc.data_ptr<float>() : nullptr, y2.data_ptr<float>(), xc.size(0), n, k, group_size};
    if (g.m >= kTiledRows) {
      dequant_tile_mm(xc, bc.defined() ? c10::optional<at::Tensor>(bc) : c10::nullopt, y2, n, k,
                      [&](int64_t n0, int64_t n1, float* dst) { dequant(isa, g, n0, n1, dst); });
      return;
    }
    // 64 output features per task: a multiple of every NR
    const int64_t blocks = (n + 63) / 64;
    at::parallel_for(0, blocks, grain_for(blocks, g.m * n * k),
                     [&](int64_t b0, int64_t b1) { rows(isa, g, b0 * 64, std::min(n, b1 * 64)); });
  });
}

}  // namespace
}  // namespace mtp

TORCH_LIBRARY_IMPL(mtp, CPU, m) { m.impl("linear_int4", &mtp::linear_int4_cpu); }
