// The exact AMX-BF16 multiply (amx_bf16.cpp) that mtp::linear_bf16 uses for a few rows and more on CPUs with AMX
// (Sapphire Rapids and later): y = x @ W^T (+ bias) for fp32 activations and a bf16 weight, fp32 math up to the
// order of accumulation. Callers choose it with amx_rows(m): the CPU has AMX-BF16, Linux granted the tile state,
// the kernels run the AVX-512 ISA (so set_isa(avx2 / generic) still tests the other paths on an AMX machine) and m
// reaches the measured threshold (amx_min_rows; tests set it to force the path on or off).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace mtp {

bool amx_usable();                       // AMX-BF16 + AMX-TILE, OS tile state, arch_prctl permission (checked once)
int64_t amx_min_rows(int64_t set = -1);  // the row threshold; set >= 1 sets it (1 << 30: never)
bool amx_rows(int64_t m);                // use amx_linear for an m-row multiply now

// y[i * ldy + o] = x[i, :] . w[o, :] (+ bias[o]) for i < m, o < n: x [m, k] fp32 and w [n, k] bf16, both contiguous.
// Threads split the weight's 32-row blocks (at::parallel_for); every value is one tile dot, thread-invariant.
void amx_linear(const float* x, int64_t m, int64_t k, const c10::BFloat16* w, int64_t n, const float* bias, float* y,
                int64_t ldy);

}  // namespace mtp
