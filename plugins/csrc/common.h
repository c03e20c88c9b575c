// Shared by the C++ CPU kernels of the mtp plugin ops (one .cpp per op, schemas in registration.cpp).
//
// What lives here: reading the KV pool from its address plus geometry ints (plugins/kv_pool.py's layout),
// int32/int64 metadata views, the dtype dispatch (fp32 / fp16 / bf16), the run-time ISA choice, and the
// vector primitives (dot, axpy, row conversion) in two flavours: `Generic` (portable C++) and `Avx512`
// (intrinsics, compiled for AVX-512 by function attribute, used only when the CPU has it).
//
// A kernel body is a template over the ISA; `MTP_ISA_KERNEL` instantiates it twice and calls the AVX-512
// one through a wrapper marked target(...) + flatten, so the whole body (with the inlined primitives) is
// compiled for AVX-512 while the library itself stays baseline x86-64 (no -march=native).
//
// Numerics: fp32 accumulation everywhere; conversions to the pool / activation dtype are c10's (round to
// nearest even, as torch's .to()); the library is compiled with -ffp-contract=off, so only the explicit
// FMAs of the AVX-512 primitives fuse. Every output row is computed by the same sequence of operations
// whatever else is in the batch (batch-invariant on one machine).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mtp {

#define MTP_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2")))
#define MTP_INLINE inline __attribute__((always_inline))

// ---- run-time ISA choice ------------------------------------------------------------------------------
// avx2: AVX2 + FMA without AVX-512 (e.g. AMD Zen 2/3). Only mtp::linear_bf16 has an AVX2 body; every other
// kernel runs its portable body there (MTP_ISA_KERNEL picks AVX-512 or Generic).
enum class Isa : int { generic = 0, avx512 = 1, avx2 = 2 };
bool cpu_has_avx512();   // what the CPU supports (checked once)
bool cpu_has_avx2();     // AVX2 + FMA + F16C
Isa active_isa();        // what the kernels use now (the best supported unless set_isa chose another)
void set_isa(Isa isa);   // tests: run the portable path on an AVX-512 machine

// ---- metadata ------------------------------------------------------------------------------------------
// An int32 or int64 CPU tensor read as int64 (the graphs feed int32; Python callers sometimes int64).
struct Ints {
  at::Tensor keep;  // the contiguous tensor the pointer reads
  const void* data = nullptr;
  bool wide = false;
  int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};
Ints ints(const at::Tensor& t, const char* op, const char* name);

// One plane of the pool: element offsets of (kv, block, slot, head) rows of head_dim values.
struct PoolPlane {
  char* base = nullptr;  // start of the plane
  int64_t kv_planes, num_blocks, block_size, heads, head_dim, elem_size;
  c10::ScalarType dtype;
  char* row(int64_t kv, int64_t block, int64_t slot, int64_t head) const {
    return base + ((((kv * num_blocks + block) * block_size + slot) * heads + head) * head_dim) * elem_size;
  }
};
PoolPlane pool_plane(const at::Tensor& pool_ptr, int64_t plane, int64_t num_planes, int64_t num_blocks,
                     int64_t block_size, int64_t heads, int64_t head_dim, int64_t dtype_code, int64_t kv_planes,
                     const char* op);

// The block of position `pos` for request r, or -1 (missing or past the table). Valid ids are < num_blocks.
int64_t block_of(const Ints& tables, int64_t cols, int64_t r, int64_t pos, int64_t block_size, int64_t num_blocks,
                 const char* op);

// A shape as Python prints a tuple ("(2,)", "(2, 6)"): error messages match the Python-side ones.
std::string py_shape(const at::Tensor& t);

// Kernels take fp32 / fp16 / bf16 tensors; anything else is refused with the op's name.
void check_float(const at::Tensor& t, const char* op, const char* name);

// Calls fn(T{}) with T the C++ type of a float dtype (float, c10::Half, c10::BFloat16).
template <class Fn>
auto dispatch_float(c10::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case c10::ScalarType::Float: return fn(float{});
    case c10::ScalarType::Half: return fn(c10::Half{});
    case c10::ScalarType::BFloat16: return fn(c10::BFloat16{});
    default: TORCH_CHECK_VALUE(false, "mtp: unsupported dtype ", dtype, " (fp32, fp16 or bf16)");
  }
}

// Calls fn(In{}, Out{}) with the C++ types of two float dtypes (rows in, pool out).
template <class Fn>
auto dispatch_float2(c10::ScalarType in, c10::ScalarType out, Fn&& fn) {
  return dispatch_float(in, [&](auto i) { return dispatch_float(out, [&](auto o) { return fn(i, o); }); });
}

// A write op's output: int64[1], the rows stored.
at::Tensor rows_written(int64_t written);

// ---- RoPE (neox rotate_half over x[0:rope_dim]) in fp32, exactly as plugins/rope.py / reference.py ------
// cos/sin of angle pos * inv_freq[i], both multiplied by `scale` when scale != 1 (YaRN).
void rope_cos_sin(int64_t pos, const float* inv_freq, int64_t half, float scale, float* cos_out, float* sin_out);
MTP_INLINE void rope_rotate(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] + (-b) * s[i];  // x*cos + rotate_half(x)*sin, two products then a sum (no FMA)
    x[i + half] = b * c[i] + a * s[i];
  }
}

// ---- element conversion ---------------------------------------------------------------------------------
template <class T>
MTP_INLINE float f32(T v) { return static_cast<float>(v); }
template <class T>
MTP_INLINE T from_f32(float v) { return static_cast<T>(v); }

// ---- vector primitives ----------------------------------------------------------------------------------
struct Generic {
  template <class T>
  static MTP_INLINE void to_f32(const T* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32(src[i]);
  }
  // sum_i a[i] * b[i], fp32, in a fixed order
  template <class T>
  static MTP_INLINE float dot(const float* a, const T* b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * f32(b[i + l]);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += a[i] * f32(b[i]);
    return s;
  }
  // out[r] = dot(a[r], b, n) for r < NX: one pass over b (a weight row) for several activation rows
  template <int NX, class T>
  static MTP_INLINE void dot_multi(const float* const* a, const T* b, int64_t n, float* out) {
    for (int r = 0; r < NX; ++r) out[r] = dot(a[r], b, n);
  }
  // y += w * x
  template <class T>
  static MTP_INLINE void axpy(float w, const T* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += w * f32(x[i]);
  }
  // y += w[0] * x[0] + w[1] * x[1] + ..., accumulated in that order (== NX successive axpy calls)
  template <int NX, class T>
  static MTP_INLINE void axpy_multi(const float* w, const T* const* x, float* y, int64_t n) {
    for (int r = 0; r < NX; ++r) axpy(w[r], x[r], y, n);
  }
  static MTP_INLINE void exp_sub(float* x, float m, int64_t n) {  // x[i] = exp(x[i] - m)
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - m);
  }
  static MTP_INLINE void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
  static MTP_INLINE float max(const float* x, int64_t n) {
    float m = x[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
    return m;
  }
  static MTP_INLINE float sum(const float* x, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
};

struct Avx512 {
  static MTP_AVX512_TARGET inline __mmask16 tail(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static MTP_AVX512_TARGET inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static MTP_AVX512_TARGET inline __m512 load(const c10::BFloat16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static MTP_AVX512_TARGET inline __m512 load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static MTP_AVX512_TARGET inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static MTP_AVX512_TARGET inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static MTP_AVX512_TARGET inline __m512 load(const c10::Half* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  template <class T>
  static MTP_AVX512_TARGET inline void to_f32(const T* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load(src + i));
    if (i < n) _mm512_mask_storeu_ps(dst + i, tail(n - i), load(src + i, tail(n - i)));
  }
  // Sums of 4 vectors' 16 lanes, each by the same pairing tree: lanes (i, i+8), then (i, i+4), (i, i+2),
  // (i, i+1). A vector's sum does not depend on the other three (pass zeros for unused ones), so reducing
  // 1 or 4 rows at once gives bit-identical results.
  static MTP_AVX512_TARGET inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
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
  // Each activation row gets two accumulators (even / odd 16-lane chunks) and the reduce4 tree, so
  // dot_multi<1> and every row of dot_multi<4> run the same operations: a row's result does not depend on
  // its neighbours.
  template <int NX, class T>
  static MTP_AVX512_TARGET inline void dot_multi(const float* const* a, const T* b, int64_t n, float* out) {
    __m512 acc0[4], acc1[4];
    for (int r = 0; r < 4; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512 b0 = load(b + i), b1 = load(b + i + 16);
      for (int r = 0; r < NX; ++r) {
        acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(a[r] + i), b0, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(a[r] + i + 16), b1, acc1[r]);
      }
    }
    for (; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail(n - i);
      const __m512 b0 = load(b + i, m);
      for (int r = 0; r < NX; ++r) acc0[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a[r] + i), b0, acc0[r]);
    }
    float sums[4];
    reduce4(_mm512_add_ps(acc0[0], acc1[0]), _mm512_add_ps(acc0[1], acc1[1]), _mm512_add_ps(acc0[2], acc1[2]),
            _mm512_add_ps(acc0[3], acc1[3]), sums);
    for (int r = 0; r < NX; ++r) out[r] = sums[r];
  }
  template <class T>
  static MTP_AVX512_TARGET inline float dot(const float* a, const T* b, int64_t n) {
    float out;
    dot_multi<1>(&a, b, n, &out);
    return out;
  }
  template <class T>
  static MTP_AVX512_TARGET inline void axpy(float w, const T* x, float* y, int64_t n) {
    axpy_multi<1>(&w, &x, y, n);
  }
  template <int NX, class T>
  static MTP_AVX512_TARGET inline void axpy_multi(const float* w, const T* const* x, float* y, int64_t n) {
    __m512 wv[NX];
    for (int r = 0; r < NX; ++r) wv[r] = _mm512_set1_ps(w[r]);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 acc = _mm512_loadu_ps(y + i);
      for (int r = 0; r < NX; ++r) acc = _mm512_fmadd_ps(wv[r], load(x[r] + i), acc);
      _mm512_storeu_ps(y + i, acc);
    }
    if (i < n) {
      const __mmask16 m = tail(n - i);
      __m512 acc = _mm512_maskz_loadu_ps(m, y + i);
      for (int r = 0; r < NX; ++r) acc = _mm512_fmadd_ps(wv[r], load(x[r] + i, m), acc);
      _mm512_mask_storeu_ps(y + i, m, acc);
    }
  }
  // exp(x), Cephes' expf polynomial (about 1 ulp): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2
  static MTP_AVX512_TARGET inline __m512 exp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
  }
  static MTP_AVX512_TARGET inline void exp_sub(float* x, float m, int64_t n) {
    const __m512 mv = _mm512_set1_ps(m);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
    if (i < n) {
      const __mmask16 k = tail(n - i);
      _mm512_mask_storeu_ps(x + i, k, exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
    }
  }
  static MTP_AVX512_TARGET inline float max(const float* x, int64_t n) {
    __m512 m = _mm512_set1_ps(x[0]);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    if (i < n) m = _mm512_mask_max_ps(m, tail(n - i), m, _mm512_maskz_loadu_ps(tail(n - i), x + i));
    return _mm512_reduce_max_ps(m);
  }
  // 16 lane sums in index order, then reduce4's tree: fixed for a given n
  static MTP_AVX512_TARGET inline float sum(const float* x, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(x + i));
    if (i < n) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(tail(n - i), x + i));
    float out[4];
    const __m512 z = _mm512_setzero_ps();
    reduce4(s, z, z, z, out);
    return out[0];
  }
  static MTP_AVX512_TARGET inline __m512 silu_mul(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), g)))), u);
  }
  static MTP_AVX512_TARGET inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, silu_mul(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
      const __mmask16 k = tail(n - i);
      _mm512_mask_storeu_ps(out + i, k, silu_mul(_mm512_maskz_loadu_ps(k, gate + i), _mm512_maskz_loadu_ps(k, up + i)));
    }
  }
};

// dot_multi / axpy_multi for a run-time row count 1..4 (tiles of keys, values or tokens)
template <class V, class T>
MTP_INLINE void dot_n(int rows, const float* const* a, const T* b, int64_t n, float* out) {
  switch (rows) {
    case 4: V::template dot_multi<4>(a, b, n, out); break;
    case 3: V::template dot_multi<3>(a, b, n, out); break;
    case 2: V::template dot_multi<2>(a, b, n, out); break;
    default: V::template dot_multi<1>(a, b, n, out); break;
  }
}
template <class V, class T>
MTP_INLINE void axpy_n(int rows, const float* w, const T* const* x, float* y, int64_t n) {
  switch (rows) {
    case 4: V::template axpy_multi<4>(w, x, y, n); break;
    case 3: V::template axpy_multi<3>(w, x, y, n); break;
    case 2: V::template axpy_multi<2>(w, x, y, n); break;
    default: V::template axpy_multi<1>(w, x, y, n); break;
  }
}

// Instantiates BODY<Generic, ...> and BODY<Avx512, ...> (the latter compiled for AVX-512 as a whole) and
// defines NAME(args...) that calls the one active_isa() names. BODY must be a function template
// `template <class V, class... Ts> void BODY(Args...)`.
#define MTP_ISA_KERNEL(NAME, BODY)                                                            \
  template <class... Ts, class... Args>                                                       \
  MTP_AVX512_TARGET __attribute__((flatten)) auto NAME##_avx512(Args... args) {               \
    return BODY<::mtp::Avx512, Ts...>(args...);                                               \
  }                                                                                           \
  template <class... Ts, class... Args>                                                       \
  auto NAME(Args... args) {                                                                   \
    if (::mtp::active_isa() == ::mtp::Isa::avx512) return NAME##_avx512<Ts...>(args...);      \
    return BODY<::mtp::Generic, Ts...>(args...);                                              \
  }

// A per-thread scratch buffer of at least n floats (kernels run often with small sizes: no allocation).
float* scratch(int slot, int64_t n);

}  // namespace mtp
