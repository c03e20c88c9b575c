// Shared by the C++ CPU kernels of the mtp plugin ops (one .cpp per op, schemas in registration.cpp).
//
// What lives here: reading the KV pool from its address plus geometry ints (plugins/kv_pool.py's layout),
// int32/int64 metadata views, the dtype dispatch (fp32 / fp16 / bf16), the run-time ISA choice, and the
// vector primitives (dot, axpy, row conversion) in three flavours: `Generic` (portable C++), `Avx512` and
// `Avx2` (intrinsics, compiled for their ISA by function attribute, used only when the CPU has it).
//
// A kernel body is a template over the ISA; `MTP_ISA_KERNEL` instantiates it three times and calls the vector
// ones through wrappers marked target(...) + flatten, so the whole body (with the inlined primitives) is
// compiled for that ISA while the library itself stays baseline x86-64 (no -march=native).
//
// Numerics: fp32 accumulation everywhere; conversions to the pool / activation dtype are c10's (round to
// nearest even, as torch's .to()); the library is compiled with -ffp-contract=off, so only the explicit
// FMAs of the AVX-512 primitives fuse. Every output row is computed by the same sequence of operations
// whatever else is in the batch and whatever the thread count (batch- and thread-invariant on one machine; the
// kernels' at::parallel_for splits are below, "threads").
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace mtp {

#define MTP_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2")))
#define MTP_AVX2_TARGET __attribute__((target("avx2,fma,f16c,bmi2")))
#define MTP_INLINE inline __attribute__((always_inline))

// ---- run-time ISA choice ------------------------------------------------------------------------------
enum class Isa : int { generic = 0, avx512 = 1, avx2 = 2 };
bool cpu_has_avx512();   // what the CPU supports (checked once)
bool cpu_has_avx2();     // AVX2 + FMA + F16C + BMI2
Isa best_isa();          // avx512, else avx2, else generic
Isa active_isa();        // what the kernels use now (best_isa() unless set_isa chose another)
void set_isa(Isa isa);   // tests: run the portable (or AVX2) path on a machine with more
const char* isa_name(Isa isa);  // "generic", "avx2", "avx512"

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

// ---- write ops: where each packed row goes ------------------------------------------------------------------
struct RowSlot {
  int64_t row, pos, block;  // packed input row, its position, its pool block (slot = pos % block_size)
};
// The rows of a write (request r's counts[r] rows, packed in request order, at positions starts[r] + j) that are
// stored: block -1 and positions past the table store nothing. Every block id is checked here (a ValueError before
// anything is written).
std::vector<RowSlot> row_slots(const Ints& counts, const Ints& starts, const Ints& tables, int64_t num_requests,
                               int64_t cols, int64_t block_size, int64_t num_blocks, const char* op);
// The at::parallel_for grain for writing `slots` (grain_for of their work), or all of them on one thread, in row
// order, when two rows go to one pool slot (outside the contract; the last row wins, as in the reference).
int64_t write_grain(const std::vector<RowSlot>& slots, int64_t block_size, int64_t work_per_row);

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

// The same primitives 8 lanes wide for CPUs with AVX2 + FMA + F16C but no AVX-512 (AMD Zen 2/3, Intel
// before Skylake-SP): the portable loops compile to 4-lane SSE2 without FMA and call libm's expf per score.
// Tails (n % 8) go through a zero-filled 8-lane buffer. Results are fixed per row as in Avx512 (each row has
// its own accumulators and reduction tree), within the tests' tolerances of the other paths.
struct Avx2 {
  static MTP_AVX2_TARGET inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static MTP_AVX2_TARGET inline __m256 load(const c10::BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static MTP_AVX2_TARGET inline __m256 load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // the first n < 8 elements, zeros after them
  template <class T>
  static MTP_AVX2_TARGET inline __m256 load(const T* p, int64_t n) {
    alignas(32) unsigned char buf[8 * sizeof(T)] = {};
    std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(T));
    return load(reinterpret_cast<const T*>(buf));
  }
  static MTP_AVX2_TARGET inline void store(float* p, __m256 v, int64_t n) {  // the first n lanes
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
  }
  template <class T>
  static MTP_AVX2_TARGET inline void to_f32(const T* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load(src + i));
    for (; i < n; ++i) dst[i] = f32(src[i]);
  }
  // Sums of 4 vectors' 8 lanes: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) each, independent of the others
  static MTP_AVX2_TARGET inline void reduce4(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
  template <int NX, class T>
  static MTP_AVX2_TARGET inline void dot_multi(const float* const* a, const T* b, int64_t n, float* out) {
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < 4; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256 b0 = load(b + i), b1 = load(b + i + 8);
      for (int r = 0; r < NX; ++r) {
        acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i), b0, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i + 8), b1, acc1[r]);
      }
    }
    for (; i < n; i += 8) {
      if (n - i >= 8) {
        const __m256 b0 = load(b + i);
        for (int r = 0; r < NX; ++r) acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i), b0, acc0[r]);
      } else {
        const __m256 b0 = load(b + i, n - i);
        for (int r = 0; r < NX; ++r) acc0[r] = _mm256_fmadd_ps(load(a[r] + i, n - i), b0, acc0[r]);
      }
    }
    float sums[4];
    reduce4(_mm256_add_ps(acc0[0], acc1[0]), _mm256_add_ps(acc0[1], acc1[1]), _mm256_add_ps(acc0[2], acc1[2]),
            _mm256_add_ps(acc0[3], acc1[3]), sums);
    for (int r = 0; r < NX; ++r) out[r] = sums[r];
  }
  template <class T>
  static MTP_AVX2_TARGET inline float dot(const float* a, const T* b, int64_t n) {
    float out;
    dot_multi<1>(&a, b, n, &out);
    return out;
  }
  template <class T>
  static MTP_AVX2_TARGET inline void axpy(float w, const T* x, float* y, int64_t n) {
    axpy_multi<1>(&w, &x, y, n);
  }
  template <int NX, class T>
  static MTP_AVX2_TARGET inline void axpy_multi(const float* w, const T* const* x, float* y, int64_t n) {
    __m256 wv[NX];
    for (int r = 0; r < NX; ++r) wv[r] = _mm256_set1_ps(w[r]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 acc = _mm256_loadu_ps(y + i);
      for (int r = 0; r < NX; ++r) acc = _mm256_fmadd_ps(wv[r], load(x[r] + i), acc);
      _mm256_storeu_ps(y + i, acc);
    }
    if (i < n) {
      __m256 acc = load(y + i, n - i);
      for (int r = 0; r < NX; ++r) acc = _mm256_fmadd_ps(wv[r], load(x[r] + i, n - i), acc);
      store(y + i, acc, n - i);
    }
  }
  // out[i][o] = dot(a[i], b + o * ld, n) for i < nx (1..4), o < rows: an M x K by K x N micro-kernel over
  // weight rows (an expert's [N, K] rows against the M tokens that chose it). Tiles of 4 weight rows x 2
  // activation rows (8 accumulators in registers), each weight chunk converted once per tile and each
  // activation chunk loaded once for 4 weight rows. One accumulator per (row, weight row) and reduce4's tree:
  // a value does not depend on nx, rows or its place in a tile.
  template <class T>
  static MTP_AVX2_TARGET inline void rows_dot(int nx, const float* const* a, const T* b, int64_t ld, int64_t rows,
                                              int64_t n, float* const* out) {
    for (int64_t o = 0; o < rows; o += 4) {
      const T* w[4];
      for (int j = 0; j < 4; ++j) w[j] = b + std::min<int64_t>(o + j, rows - 1) * ld;  // a short tile repeats
      const int nw = static_cast<int>(std::min<int64_t>(4, rows - o));
      for (int i = 0; i < nx; i += 2) {
        if (nx - i >= 2) tile<2>(a + i, w, n, o, nw, out + i);
        else tile<1>(a + i, w, n, o, nw, out + i);
      }
    }
  }
  template <int MX, class T>
  static MTP_AVX2_TARGET inline void tile(const float* const* a, const T* const* w, int64_t n, int64_t o, int nw,
                                          float* const* out) {
    __m256 acc[MX][4];
    for (int m = 0; m < MX; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
      const __m256 w0 = load(w[0] + k), w1 = load(w[1] + k), w2 = load(w[2] + k), w3 = load(w[3] + k);
      for (int m = 0; m < MX; ++m) {
        const __m256 x = _mm256_loadu_ps(a[m] + k);
        acc[m][0] = _mm256_fmadd_ps(x, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(x, w1, acc[m][1]);
        acc[m][2] = _mm256_fmadd_ps(x, w2, acc[m][2]);
        acc[m][3] = _mm256_fmadd_ps(x, w3, acc[m][3]);
      }
    }
    if (k < n) {
      const int64_t t = n - k;
      const __m256 w0 = load(w[0] + k, t), w1 = load(w[1] + k, t), w2 = load(w[2] + k, t), w3 = load(w[3] + k, t);
      for (int m = 0; m < MX; ++m) {
        const __m256 x = load(a[m] + k, t);
        acc[m][0] = _mm256_fmadd_ps(x, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(x, w1, acc[m][1]);
        acc[m][2] = _mm256_fmadd_ps(x, w2, acc[m][2]);
        acc[m][3] = _mm256_fmadd_ps(x, w3, acc[m][3]);
      }
    }
    for (int m = 0; m < MX; ++m) {
      float sums[4];
      reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], sums);
      for (int j = 0; j < nw; ++j) out[m][o + j] = sums[j];
    }
  }
  // exp(x), the same Cephes polynomial as Avx512::exp; 2^n built in the exponent bits (the input is clamped
  // to [-87.34, 88]: n stays in [-126, 127], and the kernels only take exp of values <= 0 or of -x in SiLU)
  static MTP_AVX2_TARGET inline __m256 exp(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  static MTP_AVX2_TARGET inline void exp_sub(float* x, float m, int64_t n) {
    const __m256 mv = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    if (i < n) store(x + i, exp(_mm256_sub_ps(load(x + i, n - i), mv)), n - i);
  }
  static MTP_AVX2_TARGET inline float max(const float* x, int64_t n) {
    __m256 m = _mm256_set1_ps(x[0]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (; i < n; ++i) lanes[0] = std::max(lanes[0], x[i]);
    float out = lanes[0];
    for (int l = 1; l < 8; ++l) out = std::max(out, lanes[l]);
    return out;
  }
  // 8 lane sums in index order, then reduce4's tree: fixed for a given n
  static MTP_AVX2_TARGET inline float sum(const float* x, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + i));
    if (i < n) s = _mm256_add_ps(s, load(x + i, n - i));
    float out[4];
    const __m256 z = _mm256_setzero_ps();
    reduce4(s, z, z, z, out);
    return out[0];
  }
  static MTP_AVX2_TARGET inline __m256 silu_mul(__m256 g, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u);
  }
  static MTP_AVX2_TARGET inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, silu_mul(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) store(out + i, silu_mul(load(gate + i, n - i), load(up + i, n - i)), n - i);
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

// out[i][o] = dot(a[i], b + o * ld, n) for i < nx (1..4), o < rows (weight rows against up to 4 tokens):
// AVX2's tiled micro-kernel, else one weight row at a time against the nx tokens (dot_multi).
template <class V, class T>
MTP_INLINE void rows_dot(int nx, const float* const* a, const T* b, int64_t ld, int64_t rows, int64_t n,
                         float* const* out) {
  if constexpr (std::is_same_v<V, Avx2>) {
    V::rows_dot(nx, a, b, ld, rows, n, out);
  } else {
    float tmp[4];
    for (int64_t o = 0; o < rows; ++o) {
      dot_n<V>(nx, a, b + o * ld, n, tmp);
      for (int i = 0; i < nx; ++i) out[i][o] = tmp[i];
    }
  }
}

// Instantiates BODY<Generic, ...>, BODY<Avx512, ...> and BODY<Avx2, ...> (the last two compiled for their ISA as a whole) and
// defines NAME(args...) that calls the one active_isa() names. BODY must be a function template
// `template <class V, class... Ts> void BODY(Args...)`.
#define MTP_ISA_KERNEL(NAME, BODY)                                                            \
  template <class... Ts, class... Args>                                                       \
  MTP_AVX512_TARGET __attribute__((flatten)) auto NAME##_avx512(Args... args) {               \
    return BODY<::mtp::Avx512, Ts...>(args...);                                               \
  }                                                                                           \
  template <class... Ts, class... Args>                                                       \
  MTP_AVX2_TARGET __attribute__((flatten)) auto NAME##_avx2(Args... args) {                   \
    return BODY<::mtp::Avx2, Ts...>(args...);                                                 \
  }                                                                                           \
  template <class... Ts, class... Args>                                                       \
  auto NAME(Args... args) {                                                                   \
    const ::mtp::Isa isa = ::mtp::active_isa();                                               \
    if (isa == ::mtp::Isa::avx512) return NAME##_avx512<Ts...>(args...);                      \
    if (isa == ::mtp::Isa::avx2) return NAME##_avx2<Ts...>(args...);                          \
    return BODY<::mtp::Generic, Ts...>(args...);                                              \
  }

// ---- float8_e4m3fn weights (FP8 releases: DeepSeek-V3, GLM-4.5-FP8; linear_fp8.cpp, moe_experts.cpp) ----------
// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN, exponent 0 is
// subnormal (m * 2^-9). A block-quantized weight is q * s with one fp32 scale s per 128 x 128 block; the reference
// (plugins/reference.py) rounds that product once in fp32, and so does every path here.
//
// Vector paths go through fp16, whose 5-bit exponent holds e4m3's range with its subnormals: the byte, sign-extended
// to 16 bits and shifted left 7, masked to sign | exponent | mantissa (0xbf80), is the fp16 of q * 2^-8 (normal and
// subnormal alike); F16C's vcvtph2ps widens it exactly (it handles fp16 subnormals, and q * 2^-8 is never an fp32
// subnormal). Multiplying by s * 256 (exact: a power of two) then rounds q * s once, like the reference.
// NaN: the `_nan` conversions turn 0x7f / 0xff into fp16 0xffff (NaN) lane by lane (3 more integer ops per 16
// weights); the plain ones give a finite value for them, for callers that scan each weight row once with
// e4m3_has_nan_* (2 byte ops per 64 / 32 weights) and make that row's outputs NaN, which is what the reference gives:
// a NaN weight makes its dot product NaN whatever the activation. Measured against a 256-entry LUT gather and fp32
// bit arithmetic (denormal fp32 intermediates), with and without the per-lane NaN fix: docs/PERFORMANCE.md "FP8
// weights". s * 256 overflows only for |s| >= 2^120; kernels check `fp8_scales_vector_safe` once per call and take
// the portable path (q from the table, times s) otherwise.
constexpr float e4m3_value(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7f) == 0x7f) return std::bit_cast<float>(0x7fc00000u | sign);
  if (e == 0) {  // subnormal: m * 2^-9 (exact in fp32)
    const float v = static_cast<float>(m) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((e + 120) << 23) | (m << 20));
}
struct E4m3Table {
  float v[256];
  constexpr E4m3Table() : v() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_value(static_cast<uint8_t>(i));
  }
};
inline constexpr E4m3Table kE4m3{};  // kE4m3.v[byte]: the fp32 value of an e4m3fn byte (NaN for 0x7f / 0xff)

// Whether every scale s is safe for the vector paths (s * 256 finite unless s is not finite itself).
inline bool fp8_scales_vector_safe(const float* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isfinite(s[i]) && std::fabs(s[i]) >= 0x1p120f) return false;
  return true;
}

// Whether any of n e4m3 bytes is a NaN (0x7f / 0xff): the largest of 2 * byte (mod 256) is 0xfe exactly then.
inline bool e4m3_has_nan_generic(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if ((p[i] & 0x7f) == 0x7f) return true;
  return false;
}
MTP_AVX512_TARGET inline bool e4m3_has_nan_avx512(const uint8_t* p, int64_t n) {
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
MTP_AVX2_TARGET inline bool e4m3_has_nan_avx2(const uint8_t* p, int64_t n) {
  __m256i most = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    most = _mm256_max_epu8(most, _mm256_add_epi8(b, b));
  }
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(most, _mm256_set1_epi8(static_cast<char>(0xfe)))) != 0 ||
         e4m3_has_nan_generic(p + i, n - i);
}

// 16 e4m3 bytes (the first n, zeros after) -> 16 fp32 of q * 2^-8 (a NaN byte: finite, see above / NaN with _nan);
// multiply by s * 256 with a maskz_mul (a masked-off lane must stay 0, not 0 * s).
MTP_AVX512_TARGET inline __m256i e4m3x16_fp16_avx512(const uint8_t* p, __mmask16 m) {
  const __m256i h = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, p));
  return _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
}
MTP_AVX512_TARGET inline __m512 e4m3x16_avx512(const uint8_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(e4m3x16_fp16_avx512(p, m));
}
MTP_AVX512_TARGET inline __m512 e4m3x16_nan_avx512(const uint8_t* p, __mmask16 m) {
  const __m256i h = e4m3x16_fp16_avx512(p, m);
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)),
                                                _mm256_set1_epi16(0x3f80));
  return _mm512_cvtph_ps(_mm256_mask_set1_epi16(h, nan, -1));
}
// 16 e4m3 bytes -> two 8-lane fp32 vectors of q * 2^-8 (AVX2 + F16C; a NaN byte gives a finite value)
MTP_AVX2_TARGET inline void e4m3x16_avx2(const uint8_t* p, __m256& lo, __m256& hi) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
// 8 e4m3 bytes -> 8 fp32 of q * 2^-8 (AVX2 + F16C); NaN bytes give NaN with `nan`
template <bool nan = false>
MTP_AVX2_TARGET inline __m256 e4m3x8_avx2(const uint8_t* p) {
  __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<short>(0xbf80)));
  if constexpr (nan)
    h = _mm_or_si128(h, _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80)));
  return _mm256_cvtph_ps(h);
}

// ---- FP8 weight-row tiles: dot products of e4m3 weight rows with fp32 activation rows (linear_fp8, moe_experts) ----
// A tile is NR weight rows (k apart, all in one scale row `srow`: one fp32 scale per 128 columns) against MR
// activation rows: out[r * NR + j] = x[r] . (q[j] * s), each weight rounded once. Accumulator lane l of (r, j) sums
// the columns i with i % width == l in column order, then one fixed reduction: a (row, output) value does not
// depend on MR, NR or the rest of the batch. The vector tiles convert without the per-lane NaN fix: quant_rows scans
// each weight row once (has_nan) and makes its outputs NaN; the portable tile reads NaN from the table.
constexpr int64_t kFp8Block = 128;     // the releases' weight_block_size, both dims
constexpr int64_t kFp8Prefetch = 2048;  // software prefetch distance along each weight row (bytes), 2 KB ahead
MTP_INLINE float e4m3_times(uint8_t q, float s) { return kE4m3.v[q] * s; }

// portable: 8 partial sums per dot, (0+1)+(2+3) + (4+5)+(6+7), then the tail (linear_bf16's order)
template <int MR, int NR>
inline void fp8_tile_generic(const float* const* x, const uint8_t* w, const float* srow, int64_t k, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const uint8_t* wj = w + j * k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8) {
        const float s = srow[i / kFp8Block];  // 8 columns never straddle a 128-column block
        for (int l = 0; l < 8; ++l) acc[l] += x[r][i + l] * e4m3_times(wj[i + l], s);
      }
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < k; ++i) sum += x[r][i] * e4m3_times(wj[i], srow[i / kFp8Block]);
      out[r * NR + j] = sum;
    }
}

MTP_AVX2_TARGET inline float fp8_hsum8(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7)): fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r * NR + j] = x[r] . dequant(w[j]) for MR activation rows and NR weight rows (w rows k apart, all in the
// scale row `srow`). Accumulator lane l sums the columns i with i % 8 == l, in column order.
template <int MR, int NR>
MTP_AVX2_TARGET inline void fp8_tile_avx2(const float* const* x, const uint8_t* w, const float* srow, int64_t k,
                                      float* out) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (int64_t c0 = 0; c0 < k; c0 += kFp8Block) {
    const __m256 sv = _mm256_set1_ps(srow[c0 / kFp8Block] * 256.0f);  // q * 2^-8 from the conversion
    const int64_t end = std::min(k, c0 + kFp8Block);
    for (i = c0; i + 16 <= end; i += 16) {
      if (i % 64 == 0)
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kFp8Prefetch), _MM_HINT_T0);
      for (int j = 0; j < NR; ++j) {
        __m256 lo, hi;
        e4m3x16_avx2(w + j * k + i, lo, hi);
        lo = _mm256_mul_ps(lo, sv);
        hi = _mm256_mul_ps(hi, sv);
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), lo, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i + 8), hi, acc[r][j]);
        }
      }
    }
    if (i + 8 <= end) {
      for (int j = 0; j < NR; ++j) {
        const __m256 wv = _mm256_mul_ps(e4m3x8_avx2(w + j * k + i), sv);
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), wv, acc[r][j]);
      }
      i += 8;
    }
  }
  // i < k only after the last (partial) block: fewer than 8 columns, scalar, in column order
  const float slast = k > 0 ? srow[(k - 1) / kFp8Block] : 0.0f;
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float s = fp8_hsum8(acc[r][j]);
      for (int64_t t = i; t < k; ++t) s += x[r][t] * e4m3_times(w[j * k + t], slast);
      out[r * NR + j] = s;
    }
}

template <int MR, int NR>
MTP_AVX512_TARGET inline void fp8_tile_avx512(const float* const* x, const uint8_t* w, const float* srow, int64_t k,
                                          float* out) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  // one 16-column step: masked (the last partial chunk) or not; masked-off lanes are 0, not 0 * s (NaN for an
  // infinite scale)
  auto step = [&](int64_t i, __m512 sv, __mmask16 m, auto masked) MTP_AVX512_TARGET {
    __m512 wv[NR];
    if constexpr (masked) {
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_mul_ps(m, e4m3x16_avx512(w + j * k + i, m), sv);
    } else {
      for (int j = 0; j < NR; ++j) {
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i)));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
        wv[j] = _mm512_mul_ps(_mm512_cvtph_ps(h), sv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = masked ? _mm512_maskz_loadu_ps(m, x[r] + i) : _mm512_loadu_ps(x[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  };
  for (int64_t c0 = 0; c0 < k; c0 += kFp8Block) {
    const __m512 sv = _mm512_set1_ps(srow[c0 / kFp8Block] * 256.0f);
    const int64_t end = std::min(k, c0 + kFp8Block);
    int64_t i = c0;
    for (; i + 16 <= end; i += 16) {
      if (i % 64 == 0)
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kFp8Prefetch), _MM_HINT_T0);
      step(i, sv, 0, std::false_type{});
    }
    if (i < end) step(i, sv, Avx512::tail(end - i), std::true_type{});
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

// A Tile (the FP8 ones here, the int8 ones below) computes out[r * NR + j] = x[r] . dequant(w[j]) for MR
// activation rows and NR weight rows k apart: run<MR, NR>(x, w, s, k, out), with s the block's FP8 scale row or the
// NR rows' own scales (kRowScales: per-output-channel int8), and has_nan(w, k) for a weight row that must give NaN.
struct Fp8GenericTile {
  static constexpr bool kRowScales = false;  // one scale row (128 columns per scale) for all rows of a 128-row block
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const uint8_t* w, const float* s, int64_t k, float* out) {
    fp8_tile_generic<MR, NR>(x, w, s, k, out);
  }
  static MTP_INLINE bool has_nan(const uint8_t*, int64_t) { return false; }  // the table gives NaN itself
};
struct Fp8Avx2Tile {
  static constexpr bool kRowScales = false;
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const uint8_t* w, const float* s, int64_t k, float* out) {
    fp8_tile_avx2<MR, NR>(x, w, s, k, out);
  }
  static MTP_INLINE bool has_nan(const uint8_t* w, int64_t k) { return e4m3_has_nan_avx2(w, k); }
};
struct Fp8Avx512Tile {
  static constexpr bool kRowScales = false;
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const uint8_t* w, const float* s, int64_t k, float* out) {
    fp8_tile_avx512<MR, NR>(x, w, s, k, out);
  }
  static MTP_INLINE bool has_nan(const uint8_t* w, int64_t k) { return e4m3_has_nan_avx512(w, k); }
};

// NR weight rows at w (rows o .. o + NR - 1 of the caller's block) against m activation rows, MR at a time:
// out[r][o + j] = x[r] . dequant(w[j]), NaN for a weight row holding a NaN byte. s: as Tile::run takes it.
template <class Tile, int MR, int NR, class W>
MTP_INLINE void quant_block(int64_t m, const float* const* x, const W* w, const float* s, int64_t k,
                            float* const* out, int64_t o) {
  float res[MR * NR];
  bool nan[NR];
  for (int j = 0; j < NR; ++j) nan[j] = Tile::has_nan(w + j * k, k);
  for (int64_t m0 = 0; m0 < m; m0 += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, m - m0));
    const float* const* xs = x + m0;
    switch (mr) {
      case 4: if constexpr (MR >= 4) Tile::template run<4, NR>(xs, w, s, k, res); break;
      case 3: if constexpr (MR >= 3) Tile::template run<3, NR>(xs, w, s, k, res); break;
      case 2: if constexpr (MR >= 2) Tile::template run<2, NR>(xs, w, s, k, res); break;
      default: Tile::template run<1, NR>(xs, w, s, k, res); break;
    }
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) out[m0 + r][o + j] = nan[j] ? std::numeric_limits<float>::quiet_NaN() : res[r * NR + j];
  }
}

// out[r][o] = x[r] . dequant(w[o]) for r < m activation rows and o < rows weight rows (k elements apart): blocks of
// NR weight rows, then single rows. s: the FP8 scale row all these rows use, or (Tile::kRowScales) one scale per row.
template <class Tile, int MR, int NR, class W>
MTP_INLINE void quant_rows(int64_t m, const float* const* x, const W* w, const float* s, int64_t rows, int64_t k,
                           float* const* out) {
  int64_t o = 0;
  for (; o + NR <= rows; o += NR) quant_block<Tile, MR, NR>(m, x, w + o * k, Tile::kRowScales ? s + o : s, k, out, o);
  for (; o < rows; ++o) quant_block<Tile, MR, 1>(m, x, w + o * k, Tile::kRowScales ? s + o : s, k, out, o);
}

// ---- int8 weight-row tiles: weight-only int8 with one fp32 scale per weight row (linear_int8, moe_experts_int8) ---
// `mtp-build --quantize int8`'s format (plugins/reference.py quantize_int8): dequant(w[j]) = fp32(q[j]) * s[j], each
// weight rounded once as the reference rounds it, fp32 math. out[r * NR + j] = x[r] . dequant(w[j]) for MR activation
// rows and NR weight rows k apart.
// Accumulator lane l of (r, j) sums the columns i with i % width == l in column order, then a fixed reduction (the
// FP8 tiles' trees), so a (row, output) value does not depend on MR, NR or the batch.

// portable: 8 partial sums per dot, (0+1)+(2+3) + (4+5)+(6+7), then the tail (linear_bf16's / linear_fp8's order)
template <int MR, int NR>
inline void int8_tile_generic(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const int8_t* wj = w + j * k;
      const float sj = s[j];
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[r][i + l] * (static_cast<float>(wj[i + l]) * sj);
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < k; ++i) sum += x[r][i] * (static_cast<float>(wj[i]) * sj);
      out[r * NR + j] = sum;
    }
}

MTP_AVX2_TARGET inline __m256 int8x8_avx2(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

template <int MR, int NR>
MTP_AVX2_TARGET inline void int8_tile_avx2(const float* const* x, const int8_t* w, const float* s, int64_t k,
                                           float* out) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if (i % 64 == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kFp8Prefetch), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i));
      const __m256 sv = _mm256_set1_ps(s[j]);
      const __m256 lo = _mm256_mul_ps(int8x8_avx2(b), sv), hi = _mm256_mul_ps(int8x8_avx2(_mm_srli_si128(b, 8)), sv);
      for (int r = 0; r < MR; ++r) {
        acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), lo, acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i + 8), hi, acc[r][j]);
      }
    }
  }
  if (i + 8 <= k) {
    for (int j = 0; j < NR; ++j) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * k + i));
      const __m256 wv = _mm256_mul_ps(int8x8_avx2(b), _mm256_set1_ps(s[j]));
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), wv, acc[r][j]);
    }
    i += 8;
  }
  // fewer than 8 columns left: scalar, in column order
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float sum = fp8_hsum8(acc[r][j]);
      for (int64_t t = i; t < k; ++t) sum += x[r][t] * (static_cast<float>(w[j * k + t]) * s[j]);
      out[r * NR + j] = sum;
    }
}

// 16 int8 (the first lanes of mask m, zeros after) -> 16 fp32 times the scale; masked-off lanes stay 0 (not 0 * s,
// NaN for an infinite scale)
MTP_AVX512_TARGET inline __m512 int8x16_avx512(const int8_t* p, __mmask16 m, __m512 sv) {
  return _mm512_maskz_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p))), sv);
}

template <int MR, int NR>
MTP_AVX512_TARGET inline void int8_tile_avx512(const float* const* x, const int8_t* w, const float* s, int64_t k,
                                               float* out) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  auto step = [&](int64_t i, __mmask16 m, auto masked) MTP_AVX512_TARGET {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) {
      const __m512 sv = _mm512_set1_ps(s[j]);
      if constexpr (masked) {
        wv[j] = int8x16_avx512(w + j * k + i, m, sv);
      } else {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i));
        wv[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), sv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = masked ? _mm512_maskz_loadu_ps(m, x[r] + i) : _mm512_loadu_ps(x[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if (i % 64 == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kFp8Prefetch), _MM_HINT_T0);
    step(i, 0, std::false_type{});
  }
  if (i < k) step(i, Avx512::tail(k - i), std::true_type{});
  for (int r = 0; r < MR; ++r) {
    float sums[4];
    static_assert(NR == 1 || NR == 4, "reduce4 takes 4 accumulators");
    const __m512 z = _mm512_setzero_ps();
    if constexpr (NR == 4) Avx512::reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
    else Avx512::reduce4(acc[r][0], z, z, z, sums);
    for (int q = 0; q < NR; ++q) out[r * NR + q] = sums[q];
  }
}

// common.h's Tile interface: one scale per weight row (quant_rows passes s + o), no NaN weights
struct Int8Tile {
  static constexpr bool kRowScales = true;
  static MTP_INLINE bool has_nan(const int8_t*, int64_t) { return false; }
};
struct Int8GenericTile : Int8Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
    int8_tile_generic<MR, NR>(x, w, s, k, out);
  }
};
struct Int8Avx2Tile : Int8Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
    int8_tile_avx2<MR, NR>(x, w, s, k, out);
  }
};
struct Int8Avx512Tile : Int8Tile {
  template <int MR, int NR>
  static MTP_INLINE void run(const float* const* x, const int8_t* w, const float* s, int64_t k, float* out) {
    int8_tile_avx512<MR, NR>(x, w, s, k, out);
  }
};

// ---- packed int4 weights (linear_int4): two signed 4-bit values per byte, column 2i in the low nibble of byte i,
// column 2i + 1 in the high one (plugins/reference.py pack_int4). The unpack gives the nibbles as unsigned bytes
// 0..15 in column order: the caller maps them to the two's-complement values -8..7 (a 16-entry table).
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

// A per-thread scratch buffer of at least n floats (kernels run often with small sizes: no allocation).
// thread_local, so each OpenMP thread of an at::parallel_for has its own (keyed by the OS thread, which is what an
// OpenMP thread is; an array indexed by at::get_thread_num() would need resizing whenever torch.set_num_threads
// changes). The calling thread is OpenMP thread 0 of the region and runs a share of the items itself: a buffer the
// caller takes to share with the region (MoE's per-pair rows, GDN's conv outputs) must use a slot no parallel body
// takes, and a body must read a thread_local (e.g. a std::vector) through a pointer taken by the caller, never by
// its name (the name inside the lambda is the executing thread's own, empty, copy).
constexpr int kScratchSlots = 6;
float* scratch(int slot, int64_t n);

// ---- threads -----------------------------------------------------------------------------------------------------
// The kernels split into work items with at::parallel_for (OpenMP, the threads torch.set_num_threads gives). Each
// output value is computed by one item, by the same operations whatever the item boundaries, so results do not
// depend on the thread count. Waking the pool costs microseconds to tens of microseconds (libgomp; the runtime sets
// OMP_WAIT_POLICY=PASSIVE, so the workers sleep between regions), so a thread must get at least this much work
// (multiply-adds, roughly: ~30-60 us at these kernels' speeds) or the call runs inline: decode of a tiny model stays
// on the calling thread. Measured with 2^16 on the shared 2-core VM (docs/PERFORMANCE.md "Kernel threads"): splits
// of 2^16-2^17 per thread (models/deep verify, 11-36 us calls) ran 0.56-0.66x as fast with 2 passive threads.
constexpr int64_t kMinThreadWork = int64_t{1} << 18;

// The at::parallel_for grain for `items` items costing `work` together (about equal items): the range runs inline
// below kMinThreadWork of work, and each thread gets >= kMinThreadWork otherwise (parallel_for uses at most
// items / grain threads).
inline int64_t grain_for(int64_t items, int64_t work) {
  if (items <= 0 || work < 2 * kMinThreadWork) return std::max<int64_t>(items, 1);
  const long double per_item = static_cast<long double>(work) / static_cast<long double>(items);
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(kMinThreadWork / per_item)), 1, items);
}

}  // namespace mtp
