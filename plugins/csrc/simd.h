// The vector traits of the C++ kernels: one struct per instruction set (simd::Avx512, 16 fp32 lanes; simd::Avx2,
// 8 lanes) that names the few operations a kernel body needs: load / convert (fp32, bf16, fp16, e4m3, int8), partial
// loads and stores, arithmetic, fma, the horizontal sums. The vector bodies are written once over these traits
// (simd_body.inc: the primitives and the weight-row tile of `Vector<S>`) and compiled once per ISA, in the spirit of
// ggml's simd-mappings.h; a new weight format is a struct of loads in tiles.h and reuses the bodies.
//
// How the bodies get compiled for their ISA: these members carry the ISA's target attribute and are plain `inline`;
// common.h includes simd_body.inc once per ISA under `#pragma GCC target(...)`, so the bodies carry it too and
// inline them. Kernel bodies templated over V (attention, MoE, ...) have no attribute and are only ever called from
// the per-ISA wrappers marked target(...) + flatten (MTP_ISA_KERNEL), which inline the body and, through it, the
// primitives. The library stays baseline x86-64.
//
// What stays per ISA on purpose (each kernel's summation order is kept exactly, so results are bit-identical to the
// twin bodies this replaced): the horizontal-sum trees (reduce4, hsum), how a partial chunk is handled
// (kMaskedTail: AVX-512 runs one masked step, AVX2's tiles a scalar tail after the reduction), exp's last step
// (scalef vs exponent bits), the max reduction and the int4 tile's even / odd step (kEvenOddI4: AVX-512 only,
// linear_int4's order).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// The weight formats' loads (tiles.h: always_inline, no target attribute) return vectors; they are only ever inlined
// into the per-ISA bodies (`objdump -dr` of the library shows no call into mtp::simd::), so the ABI note GCC gives
// for a vector return outside its ISA does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12 flags the self-initialized `_mm512_undefined_ps()` inside `_mm512_shuffle_f32x4` (reduce4) as uninitialized
// once the 8-row tiles inline it (a known false positive of its headers, gone in GCC 13)
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace mtp {

#define MTP_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2")))
#define MTP_AVX2_TARGET __attribute__((target("avx2,fma,f16c,bmi2")))
#define MTP_INLINE inline __attribute__((always_inline))

// ---- packed int4 weights (the traits' int4 loads, tiles.h Int4Weights): two signed 4-bit values per
// byte, column 2i in the low nibble of byte i, column 2i + 1 in the high one (plugins/reference.py pack_int4). The
// unpack gives the nibbles as unsigned bytes 0..15 in column order: the caller maps them to the two's-complement
// values -8..7 (a 16-entry table).
// 8 packed bytes (16 columns) -> 16 bytes, column order
MTP_AVX2_TARGET inline __m128i int4x16_nibbles(__m128i packed8) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(packed8, low4), hi = _mm_and_si128(_mm_srli_epi16(packed8, 4), low4);
  return _mm_unpacklo_epi8(lo, hi);  // lo0 hi0 lo1 hi1 ...
}
// The two's-complement value of each nibble byte (0..15 -> 0..7, -8..-1) as signed bytes (pshufb table lookup)
MTP_AVX2_TARGET inline __m128i int4x16_signed(__m128i nibbles) {
  return _mm_shuffle_epi8(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1), nibbles);
}

namespace simd {

constexpr int64_t kTilePrefetch = 2048;  // software prefetch distance in each weight row's stream (bytes; Vector::line_start)

// e4m3fn bytes -> fp16 bits of q * 2^-8 (common.h "float8_e4m3fn weights" says why): sign-extend, shift left 7,
// keep sign | exponent | mantissa; `nan`: 0x7f / 0xff become fp16 NaN (0xffff) lane by lane.
constexpr short kE4m3Fp16Bits = static_cast<short>(0xbf80);  // sign | exponent | mantissa of the shifted word
MTP_AVX2_TARGET inline __m128i e4m3x8_fp16(__m128i bytes, bool nan) {
  __m128i h = _mm_cvtepi8_epi16(bytes);
  h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(kE4m3Fp16Bits));
  if (nan) h = _mm_or_si128(h, _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80)));
  return h;
}
// The same for 16 bytes (no NaN lanes): both 8-lane halves of AVX2's paired step, or one AVX-512 vector.
MTP_AVX2_TARGET inline __m256i e4m3x16_fp16(__m128i bytes) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(kE4m3Fp16Bits));
}

struct Avx512 {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;       // zmm registers a tile may fill
  static constexpr bool kMaskedTail = true;   // a partial chunk is one masked vector step
  static constexpr bool kRowsDotTiles = false;
  // FP8 tiles step 2W columns: one 32-byte e4m3 -> fp16 conversion (sign-extend, shift, mask on 32 lanes) gives both
  // 16-lane halves (load_e4m3_x2); see Avx2
  static constexpr bool kPairedE4m3 = true;
  static constexpr bool kPairedI4 = true;     // load_i4_scaled_x2: 2W columns, column order, in 6 instructions
  static constexpr bool kEvenOddI4 = true;    // the int4 tile's even / odd 2W-column step (load_i4_even_odd)

  static MTP_AVX512_TARGET inline __mmask16 tail(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static MTP_AVX512_TARGET inline F zero() { return _mm512_setzero_ps(); }
  static MTP_AVX512_TARGET inline F set1(float v) { return _mm512_set1_ps(v); }
  static MTP_AVX512_TARGET inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static MTP_AVX512_TARGET inline F load(const c10::BFloat16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static MTP_AVX512_TARGET inline F load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // the first n (< W, or any n with the mask of tail(n)) elements, zeros after them
  static MTP_AVX512_TARGET inline F load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static MTP_AVX512_TARGET inline F load(const c10::BFloat16* p, __mmask16 m) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static MTP_AVX512_TARGET inline F load(const c10::Half* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  template <class T>
  static MTP_AVX512_TARGET inline F load_n(const T* p, int64_t n) { return load(p, tail(n)); }
  static MTP_AVX512_TARGET inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static MTP_AVX512_TARGET inline void store_n(float* p, F v, int64_t n) { _mm512_mask_storeu_ps(p, tail(n), v); }
  static MTP_AVX512_TARGET inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static MTP_AVX512_TARGET inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static MTP_AVX512_TARGET inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // a * b in the first n lanes, 0 after them (not 0 * b: NaN for an infinite scale)
  static MTP_AVX512_TARGET inline F mul_n(F a, F b, int64_t n) { return _mm512_maskz_mul_ps(tail(n), a, b); }
  static MTP_AVX512_TARGET inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  static MTP_AVX512_TARGET inline F vmax(F a, F b) { return _mm512_max_ps(a, b); }
  static MTP_AVX512_TARGET inline F vmin(F a, F b) { return _mm512_min_ps(a, b); }
  static MTP_AVX512_TARGET inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
  static MTP_AVX512_TARGET inline F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static MTP_AVX512_TARGET inline F round(F x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static constexpr float kExpHi = 88.37626f;  // exp's input clamp (scalef handles n = 128)
  static MTP_AVX512_TARGET inline F pow2_mul(F y, F n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
  // Sums of 4 vectors' 16 lanes, each by the same pairing tree: lanes (i, i+8), then (i, i+4), (i, i+2),
  // (i, i+1). A vector's sum does not depend on the other three (pass zeros for unused ones), so reducing
  // 1 or 4 rows at once gives bit-identical results.
  static MTP_AVX512_TARGET inline void reduce4(F a, F b, F c, F d, float* out) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, t);
    out[0] = lanes[0];
    out[1] = lanes[4];
    out[2] = lanes[8];
    out[3] = lanes[12];
  }
  // The tiles' sums of 4 accumulators (zeros for unused ones): reduce4's tree. (Vectors by value: an accumulator
  // array whose address is taken stays in memory.)
  static MTP_AVX512_TARGET inline void hsum4(F a, F b, F c, F d, float* out) { reduce4(a, b, c, d, out); }
  // the largest of m's lanes and the n (< W) values at p
  static MTP_AVX512_TARGET inline float max_rest(F m, const float* p, int64_t n) {
    if (n) m = _mm512_mask_max_ps(m, tail(n), m, _mm512_maskz_loadu_ps(tail(n), p));
    return _mm512_reduce_max_ps(m);
  }
  // W e4m3 bytes -> fp32 of q * 2^-8 (a NaN byte: finite; the tiles scan rows with e4m3_has_nan) / NaN (`_nan`)
  static MTP_AVX512_TARGET inline __m256i e4m3_fp16(const uint8_t* p, __mmask16 m) {
    return e4m3x16_fp16(_mm_maskz_loadu_epi8(m, p));
  }
  static MTP_AVX512_TARGET inline F load_e4m3(const uint8_t* p) {
    return _mm512_cvtph_ps(e4m3x16_fp16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static MTP_AVX512_TARGET inline void load_e4m3_x2(const uint8_t* p, F& lo, F& hi) {  // 32 bytes: columns 0-15, 16-31
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(kE4m3Fp16Bits));  // e4m3x16_fp16, 32 lanes
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  static MTP_AVX512_TARGET inline F load_e4m3_n(const uint8_t* p, int64_t n) {
    return _mm512_cvtph_ps(e4m3_fp16(p, tail(n)));
  }
  static MTP_AVX512_TARGET inline F load_e4m3_nan_n(const uint8_t* p, int64_t n) {
    const __m256i h = e4m3_fp16(p, tail(n));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)),
                                                  _mm256_set1_epi16(0x3f80));
    return _mm512_cvtph_ps(_mm256_mask_set1_epi16(h, nan, -1));
  }
  static MTP_AVX512_TARGET inline F load_e4m3_nan(const uint8_t* p) { return load_e4m3_nan_n(p, W); }
  static MTP_AVX512_TARGET inline F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static MTP_AVX512_TARGET inline F load_i8_n(const int8_t* p, int64_t n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail(n), p)));
  }
  // The int4 tiles' loads (W packed columns at p: W / 2 bytes, column 2i in the low nibble of byte i): i4_table(s)
  // once per group and row, then load_i4_scaled(p, table) = fp32(q) * s for W columns. AVX-512: the table holds the
  // 16 products fp32(-8..7) * s (each rounded once, as the reference) and the nibbles index it with one permute
  // (linear_int4's idea), instead of sign-extend + convert + multiply.
  static MTP_AVX512_TARGET inline F i4_table(float s) {
    return _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1), _mm512_set1_ps(s));
  }
  static MTP_AVX512_TARGET inline F load_i4_scaled(const uint8_t* p, F table) {
    const __m128i nib = int4x16_nibbles(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib), table);
  }
  // the first n (even, < W) columns, 0 after them (not 0 * s)
  static MTP_AVX512_TARGET inline F load_i4_scaled_n(const uint8_t* p, int64_t n, F table) {
    const __m128i nib = int4x16_nibbles(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (n / 2)) - 1u), p));
    return _mm512_maskz_permutexvar_ps(tail(n), _mm512_cvtepu8_epi32(nib), table);
  }
  // 2W columns (W bytes) in column order (the experts' int4 tiles): the even / odd columns as load_i4_even_odd
  // gets them, interleaved back with one two-source permute per half. 6 instructions per 2W columns where two
  // load_i4_scaled took 12 (the nibble split and the byte unpack of each 8 bytes): the experts' int4 tiles at one
  // token were bound by them.
  static MTP_AVX512_TARGET inline void load_i4_scaled_x2(const uint8_t* p, F table, F& lo, F& hi) {
    F even, odd;
    load_i4_even_odd(p, table, even, odd);
    lo = _mm512_permutex2var_ps(even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd);
    hi = _mm512_permutex2var_ps(even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                                odd);
  }
  // 2W columns (W bytes) not in column order, for the int4 tile's even / odd step (linear_int4's, Vector::tile_int4):
  // the bytes widened to W int32 lanes are the permute indexes of the W even columns as they are (the permute reads
  // the low 4 bits) and of the W odd ones shifted right by 4, so a weight costs about a quarter of an instruction
  // (column order, load_i4_scaled: about half). even = columns 0, 2, .., 2W - 2 times s, odd = 1, 3, .., 2W - 1.
  static MTP_AVX512_TARGET inline void load_i4_even_odd(const uint8_t* p, F table, F& even, F& odd) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    even = _mm512_permutexvar_ps(b, table);
    odd = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
  // The activations of that step: 2W consecutive values (lo, then hi) split into their even and odd columns
  static MTP_AVX512_TARGET inline void even_odd(F lo, F hi, F& even, F& odd) {
    even = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi);
    odd = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi);
  }
  // The tiles' NaN scan, one 64-byte line of a weight row at a time as the tile streams it (Vector::tile):
  // nan_line folds the line into `most` (the largest 2 * byte, mod 256, per byte lane), nan_seen says whether a NaN
  // byte (0x7f / 0xff: 2 * byte is 0xfe exactly then) went in.
  using Bytes = __m512i;
  static MTP_AVX512_TARGET inline Bytes nan_none() { return _mm512_setzero_si512(); }
  static MTP_AVX512_TARGET inline Bytes nan_line(Bytes most, const uint8_t* p) {
    const __m512i b = _mm512_loadu_si512(p);
    return _mm512_max_epu8(most, _mm512_add_epi8(b, b));
  }
  static MTP_AVX512_TARGET inline bool nan_seen(Bytes most) {
    return _mm512_cmpeq_epi8_mask(most, _mm512_set1_epi8(static_cast<char>(0xfe))) != 0;
  }
  // Whether any of n e4m3 bytes is a NaN (0x7f / 0xff): the largest of 2 * byte (mod 256) is 0xfe exactly then.
  static MTP_AVX512_TARGET inline bool e4m3_has_nan(const uint8_t* p, int64_t n) {
    __m512i most = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m512i b = _mm512_loadu_si512(p + i);
      most = _mm512_max_epu8(most, _mm512_add_epi8(b, b));
    }
    if (i < n) {
      const __m512i b = _mm512_maskz_loadu_epi8(static_cast<__mmask64>(~0ull >> (64 - (n - i))), p + i);
      most = _mm512_max_epu8(most, _mm512_add_epi8(b, b));
    }
    return _mm512_cmpeq_epi8_mask(most, _mm512_set1_epi8(static_cast<char>(0xfe))) != 0;
  }
};

// The same operations 8 lanes wide for CPUs with AVX2 + FMA + F16C but no AVX-512 (AMD Zen 2/3, Intel before
// Skylake-SP). Partial chunks go through a zero-filled 8-lane buffer.
struct Avx2 {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;
  static constexpr bool kMaskedTail = false;  // the tiles add a partial chunk as a scalar tail after the reduction
  static constexpr bool kRowsDotTiles = true;  // rows_dot's 4 x 2 register tile (Vector::rows_dot_tiled)
  // FP8 tiles step 2W columns at a time: one 16-byte e4m3 conversion gives both 8-lane halves (load_e4m3_x2), ~10%
  // faster than two 8-byte ones; the accumulators see the same operations in the same order either way
  static constexpr bool kPairedE4m3 = true;
  // int4 tiles step 2W columns too: one 8-byte unpack gives both halves (load_i4_scaled_x2); 4 bytes per W columns
  // left the AVX2 experts at 1.03-1.08x int8's time
  static constexpr bool kPairedI4 = true;
  static constexpr bool kEvenOddI4 = false;  // 8 lanes: vpermps indexes 8 values, not the 16 of an int4 table

  static MTP_AVX2_TARGET inline F zero() { return _mm256_setzero_ps(); }
  static MTP_AVX2_TARGET inline F set1(float v) { return _mm256_set1_ps(v); }
  static MTP_AVX2_TARGET inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static MTP_AVX2_TARGET inline F load(const c10::BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static MTP_AVX2_TARGET inline F load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // the first n < 8 elements, zeros after them
  template <class T>
  static MTP_AVX2_TARGET inline F load_n(const T* p, int64_t n) {
    alignas(32) unsigned char buf[8 * sizeof(T)] = {};
    std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(T));
    return load(reinterpret_cast<const T*>(buf));
  }
  static MTP_AVX2_TARGET inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static MTP_AVX2_TARGET inline void store_n(float* p, F v, int64_t n) {  // the first n lanes
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
  }
  static MTP_AVX2_TARGET inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static MTP_AVX2_TARGET inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static MTP_AVX2_TARGET inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static MTP_AVX2_TARGET inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  static MTP_AVX2_TARGET inline F vmax(F a, F b) { return _mm256_max_ps(a, b); }
  static MTP_AVX2_TARGET inline F vmin(F a, F b) { return _mm256_min_ps(a, b); }
  static MTP_AVX2_TARGET inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static MTP_AVX2_TARGET inline F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static MTP_AVX2_TARGET inline F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // exp's input clamp: 2^n is built in the exponent bits, so n stays in [-126, 127] (the kernels only take exp of
  // values <= 0 or of -x in SiLU)
  static constexpr float kExpHi = 88.0f;
  static MTP_AVX2_TARGET inline F pow2_mul(F y, F n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  // Sums of 4 vectors' 8 lanes: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) each, independent of the others
  static MTP_AVX2_TARGET inline void reduce4(F a, F b, F c, F d, float* out) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
  // The tiles' sums: ((0+4)+(2+6)) + ((1+5)+(3+7)) per accumulator, a fixed order
  static MTP_AVX2_TARGET inline float hsum8(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static MTP_AVX2_TARGET inline void hsum4(F a, F b, F c, F d, float* out) {
    out[0] = hsum8(a);
    out[1] = hsum8(b);
    out[2] = hsum8(c);
    out[3] = hsum8(d);
  }
  static MTP_AVX2_TARGET inline float max_rest(F m, const float* p, int64_t n) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (int64_t i = 0; i < n; ++i) lanes[0] = std::max(lanes[0], p[i]);
    float out = lanes[0];
    for (int l = 1; l < 8; ++l) out = std::max(out, lanes[l]);
    return out;
  }
  static MTP_AVX2_TARGET inline F load_e4m3(const uint8_t* p) {
    return _mm256_cvtph_ps(e4m3x8_fp16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), false));
  }
  static MTP_AVX2_TARGET inline void load_e4m3_x2(const uint8_t* p, F& lo, F& hi) {  // 16 bytes: columns 0-7, 8-15
    const __m256i h = e4m3x16_fp16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  static MTP_AVX2_TARGET inline F load_e4m3_nan(const uint8_t* p) {
    return _mm256_cvtph_ps(e4m3x8_fp16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), true));
  }
  static MTP_AVX2_TARGET inline F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // W (8) packed int4 columns from 4 bytes -> fp32 q (sign-extended through a pshufb table, converted; the tiles add
  // a group's last < 8 columns as a scalar tail)
  static MTP_AVX2_TARGET inline F load_i4(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(int4x16_signed(int4x16_nibbles(_mm_cvtsi32_si128(four)))));
  }
  // The int4 tiles' scaled loads (see Avx512): here the "table" is the scale itself, times the converted q (vpermps
  // indexes only 8 lanes, fewer than the 16 nibble values)
  static MTP_AVX2_TARGET inline F i4_table(float s) { return _mm256_set1_ps(s); }
  static MTP_AVX2_TARGET inline F load_i4_scaled(const uint8_t* p, F scale) { return _mm256_mul_ps(load_i4(p), scale); }
  static MTP_AVX2_TARGET inline void load_i4_scaled_x2(const uint8_t* p, F scale, F& lo, F& hi) {  // 2W columns
    const __m128i q = int4x16_signed(int4x16_nibbles(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale);
    hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), scale);
  }
  using Bytes = __m256i;  // the tiles' NaN scan (see Avx512): a 64-byte line is two 32-byte halves
  static MTP_AVX2_TARGET inline Bytes nan_none() { return _mm256_setzero_si256(); }
  static MTP_AVX2_TARGET inline Bytes nan_line(Bytes most, const uint8_t* p) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    return _mm256_max_epu8(most, _mm256_max_epu8(_mm256_add_epi8(a, a), _mm256_add_epi8(b, b)));
  }
  static MTP_AVX2_TARGET inline bool nan_seen(Bytes most) {
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(most, _mm256_set1_epi8(static_cast<char>(0xfe)))) != 0;
  }
  static MTP_AVX2_TARGET inline bool e4m3_has_nan(const uint8_t* p, int64_t n) {
    __m256i most = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      most = _mm256_max_epu8(most, _mm256_add_epi8(b, b));
    }
    bool nan = _mm256_movemask_epi8(_mm256_cmpeq_epi8(most, _mm256_set1_epi8(static_cast<char>(0xfe)))) != 0;
    for (; i < n && !nan; ++i) nan = (p[i] & 0x7f) == 0x7f;
    return nan;
  }
};

}  // namespace simd
}  // namespace mtp
