// The shared pieces of common.h: ISA choice, metadata and pool views, argument checks, RoPE angles, scratch.
#include "common.h"

#include <ATen/ops/empty.h>

#include <atomic>

namespace mtp {

bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
  }();
  return has;
}

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("bmi2");
  }();
  return has;
}

Isa best_isa() { return cpu_has_avx512() ? Isa::avx512 : cpu_has_avx2() ? Isa::avx2 : Isa::generic; }

static std::atomic<int> g_isa{-1};  // -1: not chosen yet

Isa active_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(best_isa());
    g_isa.store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

void set_isa(Isa isa) {
  TORCH_CHECK_VALUE(isa != Isa::avx512 || cpu_has_avx512(), "mtp: this CPU has no AVX-512; use isa 'generic'");
  TORCH_CHECK_VALUE(isa != Isa::avx2 || cpu_has_avx2(), "mtp: this CPU has no AVX2 + FMA; use isa 'generic'");
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "generic";
}

Ints ints(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  const auto dt = t.scalar_type();
  TORCH_CHECK_VALUE(dt == c10::ScalarType::Int || dt == c10::ScalarType::Long, op, ": ", name,
                    " must be int32 or int64, got ", dt);
  Ints out;
  out.keep = t.contiguous();
  out.data = out.keep.data_ptr();
  out.wide = dt == c10::ScalarType::Long;
  return out;
}

PoolPlane pool_plane(const at::Tensor& pool_ptr, int64_t plane, int64_t num_planes, int64_t num_blocks,
                     int64_t block_size, int64_t heads, int64_t head_dim, int64_t dtype_code, int64_t kv_planes,
                     const char* op) {
  TORCH_CHECK_VALUE(pool_ptr.device().is_cpu() && pool_ptr.scalar_type() == c10::ScalarType::Long &&
                        pool_ptr.numel() >= 1,
                    op, ": pool_ptr must be the int64[1] CPU tensor of plugins.kv_pool.pool_address");
  const int64_t address = pool_ptr.contiguous().data_ptr<int64_t>()[0];
  TORCH_CHECK_VALUE(address != 0, "KV pool address is 0: the engine passed no pool");
  TORCH_CHECK_VALUE(0 <= plane && plane < num_planes, op, ": plane ", plane, " is outside the pool's ", num_planes,
                    " planes");
  TORCH_CHECK_VALUE(num_blocks > 0 && block_size > 0 && heads > 0 && head_dim > 0, op,
                    ": pool geometry must be positive (num_blocks ", num_blocks, ", block_size ", block_size,
                    ", heads ", heads, ", head_dim ", head_dim, ")");
  PoolPlane p;
  switch (dtype_code) {
    case 0: p.dtype = c10::ScalarType::Float; p.elem_size = 4; break;
    case 1: p.dtype = c10::ScalarType::Half; p.elem_size = 2; break;
    case 2: p.dtype = c10::ScalarType::BFloat16; p.elem_size = 2; break;
    default: TORCH_CHECK_VALUE(false, op, ": pool dtype code ", dtype_code, " is none of 0 (fp32), 1 (fp16), 2 (bf16)");
  }
  p.kv_planes = kv_planes;
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.heads = heads;
  p.head_dim = head_dim;
  const int64_t plane_elems = kv_planes * num_blocks * block_size * heads * head_dim;
  p.base = reinterpret_cast<char*>(address) + plane * plane_elems * p.elem_size;
  return p;
}

int64_t block_of(const Ints& tables, int64_t cols, int64_t r, int64_t pos, int64_t block_size, int64_t num_blocks,
                 const char* op) {
  const int64_t col = pos / block_size;
  if (col >= cols) return -1;
  const int64_t block = tables[r * cols + col];
  TORCH_CHECK_VALUE(block < num_blocks, op, ": block id ", block, " (request ", r, ") is outside the pool's ",
                    num_blocks, " blocks");
  return block < 0 ? -1 : block;
}

std::vector<RowSlot> row_slots(const Ints& counts, const Ints& starts, const Ints& tables, int64_t num_requests,
                               int64_t cols, int64_t block_size, int64_t num_blocks, const char* op) {
  std::vector<RowSlot> out;
  int64_t row = 0;
  for (int64_t r = 0; r < num_requests; ++r)
    for (int64_t j = 0; j < counts[r]; ++j, ++row) {
      const int64_t pos = starts[r] + j, block = block_of(tables, cols, r, pos, block_size, num_blocks, op);
      if (block >= 0) out.push_back({row, pos, block});
    }
  return out;
}

int64_t write_grain(const std::vector<RowSlot>& slots, int64_t block_size, int64_t work_per_row) {
  const int64_t n = static_cast<int64_t>(slots.size()), grain = grain_for(n, n * work_per_row);
  if (grain >= n) return std::max<int64_t>(n, 1);  // inline anyway
  std::vector<int64_t> keys(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keys[i] = slots[i].block * block_size + slots[i].pos % block_size;
  std::sort(keys.begin(), keys.end());
  return std::adjacent_find(keys.begin(), keys.end()) == keys.end() ? grain : n;
}

std::string py_shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + (t.dim() == 1 ? ",)" : ")");
}

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor here (CUDA goes to Triton)");
  const auto dt = t.scalar_type();
  TORCH_CHECK_VALUE(dt == c10::ScalarType::Float || dt == c10::ScalarType::Half || dt == c10::ScalarType::BFloat16,
                    op, ": ", name, " must be fp32, fp16 or bf16, got ", dt);
}

void rope_cos_sin(int64_t pos, const float* inv_freq, int64_t half, float scale, float* cos_out, float* sin_out) {
  const float p = static_cast<float>(pos);
  for (int64_t i = 0; i < half; ++i) {
    const float angle = p * inv_freq[i];
    cos_out[i] = std::cos(angle);
    sin_out[i] = std::sin(angle);
    if (scale != 1.0f) {
      cos_out[i] *= scale;
      sin_out[i] *= scale;
    }
  }
}

float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[kScratchSlots];
  TORCH_CHECK(0 <= slot && slot < kScratchSlots, "mtp: scratch slot ", slot, " out of range");
  auto& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
  return b.data();
}

at::Tensor rows_written(int64_t written) {
  at::Tensor result = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  result.data_ptr<int64_t>()[0] = written;
  return result;
}

}  // namespace mtp
