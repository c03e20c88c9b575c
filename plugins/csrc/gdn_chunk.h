// The chunked (WY) form of the gated delta rule for mtp::gdn_step (gdn_step.cpp): a run of one value head's rows
// whose states need not be stored (write_slots -1, except maybe the run's last row) goes through the state once per
// chunk of kGdnChunk rows instead of once per row; transformers' `torch_chunk_gated_delta_rule`, the same math.
//
// Per chunk of n rows (row i: q_i, k_i, v_i, log decay g_i, beta_i; G_i = g_0 + ... + g_i, all <= 0 differences
// below, so every exp is <= 1):
//   L[i][j] = -beta_i (k_i . k_j) exp(G_i - G_j) (j < i),  T = (I - L)^-1 (forward substitution, unit diagonal)
//   U = T diag(beta) V,  W = T diag(beta exp(G)) K       (the chunk's rows with the intra-chunk updates applied)
//   Vn = U - W S                                          (what each row adds, given the state entering the chunk)
//   O_i = exp(G_i) q_i S + sum_{j <= i} (q_i . k_j) exp(G_i - G_j) Vn_j
//   S <- exp(G_{n-1}) S + sum_j exp(G_{n-1} - G_j) k_j Vn_j^T
// The products with S (and the n x n ones) are register-tiled matrix products (gemm_acc), compiled per ISA by
// MTP_ISA_KERNEL like the other kernels; fp32 throughout, the tiles' multiply-adds fused on AVX-512 and AVX2 (gdn_fma).
// Equal to the row-by-row form up to fp32 rounding (its order of sums differs), tested against both references in
// tests/plugins/test_gdn_chunk.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace mtp {

// Rows per chunk and the shortest run that takes the chunked form (shorter runs stay row by row): measured with
// runtime/bench/gdn_prefill.py (docs/MODELS.md "Prefill").
constexpr int64_t kGdnChunk = 32;
constexpr int64_t kGdnMinChunkRun = 8;

// One value head's chunk-form input: q, k, v compact (the conv output's head segments, gdn_step.cpp GdnActs), the
// output rows out_stride floats apart (the op's output).
struct GdnChunkRows {
  const float* q;       // [n, Dk] (already l2-normalised and scaled)
  const float* k;       // [n, Dk]
  const float* v;       // [n, Dv]
  const float* g;       // [n] log decays
  const float* beta;    // [n]
  float* out;           // [n, Dv] row stride out_stride, starts at zero
  int64_t n, out_stride, dk, dv;
};

// One ISA's vector as a value (GCC's vector extension): 16 floats, one zmm, where gemm_acc is compiled for AVX-512;
// 8, one ymm, for AVX2; 4, one xmm, for the baseline. The compiler keeps a tile of them in registers, which plain
// loops over a float[4][16] did not get (measured: 3x slower). One vector per register matters: 16 floats as two ymm
// (AVX2) or four xmm (baseline) made the tile's 8 accumulators overflow the 16 registers, and the chunked form ran at
// a tenth of the row-by-row form's speed there.
typedef float GdnF16 __attribute__((vector_size(64)));  // loaded and stored through memcpy: any alignment
typedef float GdnF8 __attribute__((vector_size(32)));
typedef float GdnF4 __attribute__((vector_size(16)));
template <class V>
constexpr int gdn_lanes() {
  if constexpr (requires { V::kRegisters; }) return V::kRegisters >= 32 ? 16 : 8;
  return 4;
}
template <class V>
using GdnVec = std::conditional_t<gdn_lanes<V>() == 16, GdnF16, std::conditional_t<gdn_lanes<V>() == 8, GdnF8, GdnF4>>;

// Whether V has an FMA for its vector (AVX-512, AVX2): then the tiles multiply-add with it (one rounding per term
// instead of two; the chunked prefill ran 1.25x faster by CPU time at 2,000 tokens on Zen 4's AVX-512). The baseline
// multiplies then adds (the library's -ffp-contract=off). Only this form: the row-by-row form keeps its bits.
template <class V>
constexpr bool gdn_fma() {
  if constexpr (requires { V::kRegisters; }) return true;
  return false;
}

// C[M x N] (row stride ldc) += A[M x K] (lda) @ B[K x N] (ldb): tiles of 4 rows x 2 vectors of columns kept in
// registers, the K products added in order (each C value's sum order is fixed by its row and column alone). `lower`: A
// is lower triangular (A[i][p] = 0 for p > i: the chunk's T and decayed scores), so a tile of rows i.. stops at
// p = i + 3 (the chunk's n x n products at half the work; the zeros skipped would only have added +-0).
template <class V>
MTP_INLINE void gemm_acc(int64_t m, int64_t n, int64_t kk, const float* a, int64_t lda, const float* b, int64_t ldb,
                         float* c, int64_t ldc, bool lower = false) {
  using F = GdnVec<V>;
  constexpr int R = 4, L = gdn_lanes<V>(), NB = 2 * L;  // 8 accumulators, named so they stay in registers
  auto ld = [](const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(F));
    return v;
  };
  auto st = [](float* p, const F& v) { std::memcpy(p, &v, sizeof(F)); };
  auto madd = [](float s, const F& x, const F& acc) -> F {
    if constexpr (gdn_fma<V>()) return V::fma(V::set1(s), x, acc);
    else return acc + s * x;
  };
  int64_t i = 0;
  for (; i + R <= m; i += R) {
    const int64_t pk = lower ? std::min(kk, i + R) : kk;  // the products this tile's rows have
    const float* a0 = a + i * lda;
    const float* a1 = a0 + lda;
    const float* a2 = a1 + lda;
    const float* a3 = a2 + lda;
    float* c0 = c + i * ldc;
    float* c1 = c0 + ldc;
    float* c2 = c1 + ldc;
    float* c3 = c2 + ldc;
    int64_t e = 0;
    for (; e + NB <= n; e += NB) {
      F x0 = ld(c0 + e), y0 = ld(c0 + e + L), x1 = ld(c1 + e), y1 = ld(c1 + e + L);
      F x2 = ld(c2 + e), y2 = ld(c2 + e + L), x3 = ld(c3 + e), y3 = ld(c3 + e + L);
      for (int64_t p = 0; p < pk; ++p) {
        const F bx = ld(b + p * ldb + e), by = ld(b + p * ldb + e + L);
        const float s0 = a0[p], s1 = a1[p], s2 = a2[p], s3 = a3[p];
        x0 = madd(s0, bx, x0);
        y0 = madd(s0, by, y0);
        x1 = madd(s1, bx, x1);
        y1 = madd(s1, by, y1);
        x2 = madd(s2, bx, x2);
        y2 = madd(s2, by, y2);
        x3 = madd(s3, bx, x3);
        y3 = madd(s3, by, y3);
      }
      st(c0 + e, x0), st(c0 + e + L, y0), st(c1 + e, x1), st(c1 + e + L, y1);
      st(c2 + e, x2), st(c2 + e + L, y2), st(c3 + e, x3), st(c3 + e + L, y3);
    }
    for (int r = 0; r < R; ++r)  // the column tail, same order of sums
      for (int64_t f = e; f < n; ++f) {
        float s = c[(i + r) * ldc + f];
        for (int64_t p = 0; p < pk; ++p) s += a[(i + r) * lda + p] * b[p * ldb + f];
        c[(i + r) * ldc + f] = s;
      }
  }
  for (; i < m; ++i)  // the row tail
    for (int64_t f = 0; f < n; ++f) {
      float s = c[i * ldc + f];
      for (int64_t p = 0; p < (lower ? std::min(kk, i + 1) : kk); ++p) s += a[i * lda + p] * b[p * ldb + f];
      c[i * ldc + f] = s;
    }
}

// One chunk (n <= kGdnChunk rows) of one value head: out rows written, S [Dk, Dv] advanced past the chunk.
// `buf` holds at least gdn_chunk_scratch(dk, dv) floats.
inline int64_t gdn_chunk_scratch(int64_t dk, int64_t dv) {
  const int64_t c = kGdnChunk;
  return 4 * c * c + 2 * c + c * dk + 2 * c * dv + dk * c;
}

template <class V>
void gdn_chunk_body(const GdnChunkRows& x, float* s, float* buf) {
  const int64_t n = x.n, dk = x.dk, dv = x.dv, c = kGdnChunk;
  float* t = buf;             // [c, c] T, then T diag(beta)
  float* tw = t + c * c;      // [c, c] T diag(beta exp(G))
  float* qk = tw + c * c;     // [c, c] (q_i . k_j) exp(G_i - G_j), j <= i
  float* l = qk + c * c;      // [c, c] L
  float* gc = l + c * c;      // [c] G
  float* eg = gc + c;         // [c] exp(G)
  float* w = eg + c;          // [c, dk] W
  float* vn = w + c * dk;     // [c, dv] U, then Vn
  float* ws = vn + c * dv;    // [c, dv] W S
  float* kt = ws + c * dv;    // [dk, c] exp(G_{n-1} - G_j) k_j, transposed
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    acc += x.g[i];
    gc[i] = acc;
    eg[i] = std::exp(acc);
  }
  // k_i . k_j and q_i . k_j for every pair as two products against K^T (one short dot per pair was the chunk's
  // hottest loop), then L and the decayed scores from them
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < dk; ++i) kt[i * c + j] = x.k[j * dk + i];
  std::fill(l, l + n * c, 0.0f);
  std::fill(qk, qk + n * c, 0.0f);
  gemm_acc<V>(n, n, dk, x.k, dk, kt, c, l, c);
  gemm_acc<V>(n, n, dk, x.q, dk, kt, c, qk, c);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) {
      const float decay = std::exp(gc[i] - gc[j]);
      l[i * c + j] = -x.beta[i] * l[i * c + j] * decay;
      qk[i * c + j] *= decay;
    }
  // T = (I - L)^-1, row by row: T[i][j] = L[i][j] + sum_{j < m < i} L[i][m] T[m][j]
  for (int64_t i = 0; i < n; ++i) {
    float* ti = t + i * c;
    for (int64_t j = 0; j < n; ++j) ti[j] = 0.0f;
    ti[i] = 1.0f;
    for (int64_t m = 0; m < i; ++m) {
      const float lm = l[i * c + m];
      const float* tm = t + m * c;
      for (int64_t j = 0; j <= m; ++j) ti[j] += lm * tm[j];
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float tij = j <= i ? t[i * c + j] : 0.0f;
      tw[i * c + j] = tij * x.beta[j] * eg[j];
      t[i * c + j] = tij * x.beta[j];
      if (j > i) qk[i * c + j] = 0.0f;
    }
  // U = T diag(beta) V, W = T diag(beta exp(G)) K
  std::fill(vn, vn + n * dv, 0.0f);
  std::fill(w, w + n * dk, 0.0f);
  gemm_acc<V>(n, dv, n, t, c, x.v, dv, vn, dv, true);
  gemm_acc<V>(n, dk, n, tw, c, x.k, dk, w, dk, true);
  // Vn = U - W S
  std::fill(ws, ws + n * dv, 0.0f);
  gemm_acc<V>(n, dv, dk, w, dk, s, dv, ws, dv);
  for (int64_t i = 0; i < n * dv; ++i) vn[i] -= ws[i];
  // O = diag(exp(G)) Q S + qk Vn
  gemm_acc<V>(n, dv, dk, x.q, dk, s, dv, x.out, x.out_stride);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t e = 0; e < dv; ++e) x.out[i * x.out_stride + e] *= eg[i];
  gemm_acc<V>(n, dv, n, qk, c, vn, dv, x.out, x.out_stride, true);
  // S <- exp(G_{n-1}) S + Kd^T Vn
  const float last = gc[n - 1];
  for (int64_t j = 0; j < n; ++j) {
    const float dj = std::exp(last - gc[j]);
    const float* kj = x.k + j * dk;
    for (int64_t i = 0; i < dk; ++i) kt[i * c + j] = kj[i] * dj;
  }
  const float el = eg[n - 1];
  for (int64_t i = 0; i < dk * dv; ++i) s[i] *= el;
  gemm_acc<V>(dk, dv, n, kt, c, vn, dv, s, dv);
}

MTP_ISA_KERNEL(gdn_chunk, gdn_chunk_body)

}  // namespace mtp
