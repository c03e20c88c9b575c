// Shared by the C++ CPU kernels of the mtp plugin ops (one .cpp per op, schemas in registration.cpp).
//
// What lives here: reading the KV pool from its address plus geometry ints (plugins/kv_pool.py's layout),
// int32/int64 metadata views, the dtype dispatch (fp32 / fp16 / bf16), the run-time ISA choice, and the
// vector primitives (dot, axpy, exp, row conversion) in two bodies: `Generic` (portable C++) and `Vector<S>`
// (simd_body.inc), written once over the vector traits of simd.h and compiled as `Avx512` and `Avx2` (each for its
// ISA, used only when the CPU has it). The weight-row tiles of the linear and MoE kernels: tiles.h, over the same
// traits.
//
// A kernel body is a template over V (Generic, Avx512 or Avx2); `MTP_ISA_KERNEL` instantiates it three times and
// calls the vector ones through wrappers marked target(...) + flatten, so the whole body (with the inlined
// primitives and simd.h's members) is compiled for that ISA while the library itself stays baseline x86-64 (no
// -march=native). Every kernel's ISA dispatch goes through it (NAME(...) on active_isa(), NAME_on(isa, ...)).
//
// Numerics: fp32 accumulation everywhere; conversions to the pool / activation dtype are c10's (round to
// nearest even, as torch's .to()); the library is compiled with -ffp-contract=off, so only the explicit
// FMAs of the vector primitives fuse. Every output row is computed by the same sequence of operations
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

#include "simd.h"

namespace mtp {


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
  static constexpr bool kRowsDotTiles = false;
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

// The vector primitives and tiles, written once (simd_body.inc) and compiled once per ISA: `Avx512` and `Avx2`, what a
// kernel body templated over V calls.
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2")  // MTP_AVX512_TARGET's
#include "simd_body.inc"
#pragma GCC pop_options
}  // namespace isa_avx512
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")  // MTP_AVX2_TARGET's
#include "simd_body.inc"
#pragma GCC pop_options
}  // namespace isa_avx2
using Avx512 = isa_avx512::Vector<simd::Avx512>;
using Avx2 = isa_avx2::Vector<simd::Avx2>;


// dot_multi / axpy_multi for a run-time row count 1..4 (tiles of keys, values or tokens)
template <class V, class T, bool kAhead = false>
MTP_INLINE void dot_n(int rows, const float* const* a, const T* b, int64_t n, float* out) {
  if constexpr (kAhead && !std::is_same_v<V, Generic>) {  // the vector bodies' stream prefetch (simd_body.inc)
    switch (rows) {
      case 4: V::template dot_multi<4, T, true>(a, b, n, out); break;
      case 3: V::template dot_multi<3, T, true>(a, b, n, out); break;
      case 2: V::template dot_multi<2, T, true>(a, b, n, out); break;
      default: V::template dot_multi<1, T, true>(a, b, n, out); break;
    }
    return;
  }
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
  if constexpr (V::kRowsDotTiles) {
    V::rows_dot_tiled(nx, a, b, ld, rows, n, out);
  } else {
    float tmp[4];
    for (int64_t o = 0; o < rows; ++o) {
      if (ld == n) dot_n<V, T, true>(nx, a, b + o * ld, n, tmp);  // contiguous rows: one stream, prefetched ahead
      else dot_n<V>(nx, a, b + o * ld, n, tmp);
      for (int i = 0; i < nx; ++i) out[i][o] = tmp[i];
    }
  }
}

// Instantiates BODY<Generic, ...>, BODY<Avx512, ...> and BODY<Avx2, ...> (the last two compiled for their ISA as a
// whole: the wrapper's target attribute + flatten inline the body and, through it, simd.h's members) and defines
// NAME(args...), which calls the one active_isa() names, and NAME_on(isa, args...), for a caller that chose the ISA
// (e.g. the portable path for scales the vector conversion cannot take). BODY must be a function template
// `template <class V, class... Ts> R BODY(Args...)`. Every kernel's ISA dispatch goes through here.
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
  auto NAME##_on(::mtp::Isa isa, Args... args) {                                              \
    if (isa == ::mtp::Isa::avx512) return NAME##_avx512<Ts...>(args...);                      \
    if (isa == ::mtp::Isa::avx2) return NAME##_avx2<Ts...>(args...);                          \
    return BODY<::mtp::Generic, Ts...>(args...);                                              \
  }                                                                                           \
  template <class... Ts, class... Args>                                                       \
  auto NAME(Args... args) {                                                                   \
    return NAME##_on<Ts...>(::mtp::active_isa(), args...);                                    \
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
// weights); the plain ones give a finite value for them, for callers that scan each weight row once for NaN bytes
// (simd.h's nan_line / e4m3_has_nan: 2 byte ops per 64 / 32 weights; the tiles fold each line in as they stream it)
// and make that row's outputs NaN, which is what the reference gives:
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

constexpr int64_t kFp8Block = 128;  // the releases' weight_block_size, both dims
MTP_INLINE float e4m3_times(uint8_t q, float s) { return kE4m3.v[q] * s; }

// ---- packed int4 weights: simd.h (int4x16_nibbles, int4x16_signed: the traits' int4 loads)

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