// amx_bf16.h's exact AMX-BF16 multiply. C^T [N, M] = W [N, K] x^T: the weight is AMX's A operand straight from
// memory (tiles of 16 weight rows x 32 bf16, each weight byte read once per 32 activation rows). Each fp32
// activation is split into three bf16 parts, hi + mid + lo, that carry its 24-bit mantissa (each part is the
// rounded rest of the previous ones, so the subtractions are exact), so every bf16 x bf16 product is exact in the
// fp32 accumulator: fp32 math up to the order of accumulation (no activation is rounded to bf16, which is why
// vdpbf16ps is used nowhere). Finite activations: an infinity's rest is NaN (inf - inf), which the fp32 paths
// would not give; fp32 denormals (the tile unit flushes them) are below anything a forward carries. The parts are
// packed once per call as AMX's B operand (pairs of k, 16 activation rows per tile); three TDPBF16PS passes still
// do ~5x the multiply-adds per cycle of fp32 FMAs (docs/PERFORMANCE.md "Batch 8 on AVX-512").
#include "amx_bf16.h"

#include <ATen/Parallel.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <utility>

#include "common.h"

namespace mtp {
namespace {

constexpr int kTile = 16;   // tile rows (weight rows per A tile, k pairs per B tile) and activation rows per B tile
constexpr int kChunk = 32;  // bf16 k per tile row (64 bytes)
// measured (docs/PERFORMANCE.md "bf16 multiplies"): from 16 rows on (where MKL took over) the deep model's verify
// forward gains 1.3x at batch 8; at 8-12 rows AMX beat the register tiles per op with warm weights (1.0-1.6x) but
// lost 3-12% in the forward, whose weights stream from L3 (strided tile loads); below 8 it loses per op too.
std::atomic<int64_t> min_rows{16};

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// bf16 bits of x rounded to nearest even, in the low half of each 32-bit lane (finite x)
MTP_AVX512_TARGET inline __m512i round_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

// parts[p][mb][kp][16][2]: part p of x[mb * 16 + i][2 kp + j] at (kp, i, j); parts arrives zeroed (zeros past m
// and k: a padded k must multiply to 0, and an activation column past m lands in an output column nobody reads)
MTP_AVX512_TARGET __attribute__((flatten)) void pack_parts(const float* x, int64_t m, int64_t k, int64_t mblocks,
                                                          int64_t kpairs, uint16_t* parts) {
  const int64_t part = mblocks * kpairs * kTile * 2;
  for (int64_t r = 0; r < m; ++r) {
    uint32_t* dst[3];
    for (int p = 0; p < 3; ++p)
      dst[p] = reinterpret_cast<uint32_t*>(parts + p * part + (r / kTile) * kpairs * kTile * 2) + r % kTile;
    const float* xr = x + r * k;
    for (int64_t c = 0; c < k; c += 16) {
      __m512 rest = _mm512_maskz_loadu_ps(k - c >= 16 ? static_cast<__mmask16>(0xffff) : Avx512::tail(k - c), xr + c);
      alignas(32) uint32_t words[8];
      const int64_t pairs = std::min<int64_t>(8, (k - c + 1) / 2);
      for (int p = 0; p < 3; ++p) {
        const __m512i bits = round_bf16(rest);  // part p, then what it leaves
        rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(words), _mm512_cvtepi32_epi16(bits));  // 8 pairs of k
        for (int64_t i = 0; i < pairs; ++i) dst[p][(c / 2 + i) * kTile] = words[i];
      }
    }
  }
}

// One 16-row weight block at n0 as an A operand: straight from memory, or a zero-padded copy in pad for a partial
// block or a k that is not a multiple of 32 (a tile row never reads past its row). Returns (pointer, stride bytes).
inline std::pair<const uint16_t*, int64_t> a_block(const uint16_t* w, int64_t n, int64_t k, int64_t kpad, int64_t n0,
                                                   std::vector<uint16_t>& pad) {
  const int64_t nr = std::min<int64_t>(kTile, n - n0);
  if (nr == kTile && k % kChunk == 0) return {w + n0 * k, k * 2};
  pad.assign(static_cast<size_t>(kTile * kpad), 0);
  for (int64_t r = 0; r < nr; ++r) std::memcpy(pad.data() + r * kpad, w + (n0 + r) * k, sizeof(uint16_t) * k);
  return {pad.data(), kpad * 2};
}

// Weight rows [32 b0, 32 b1) against every activation block; parts from pack_parts. Per step two weight blocks (A
// tiles 4, 5) x two activation blocks (B tiles 6, 7) into four accumulators (C tiles 0-3): each B tile loaded serves
// two weight blocks, which halves the part traffic from L2 (the parts of K = 1024 outgrow L1).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2"))) void blocks(
    const uint16_t* parts, int64_t m, int64_t k, const uint16_t* w, int64_t n, const float* bias, float* y,
    int64_t ldy, int64_t b0, int64_t b1) {
  const int64_t mblocks = (m + kTile - 1) / kTile, kchunks = (k + kChunk - 1) / kChunk;
  const int64_t kpairs = kchunks * kTile, part = mblocks * kpairs * kTile * 2, kpad = kchunks * kChunk;
  const int64_t bstep = kpairs * kTile * 2;  // elements from one activation block's part to the next's
  thread_local std::vector<uint16_t> pad[2];
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTile, cfg.colsb[t] = 64;  // every tile 16 rows x 64 bytes
  _tile_loadconfig(&cfg);  // per thread: the tile state is the thread's
  alignas(64) float c[4][kTile * kTile];
  for (int64_t n0 = b0 * 2 * kTile; n0 < std::min(n, b1 * 2 * kTile); n0 += 2 * kTile) {
    const bool n2 = n0 + kTile < n;
    const auto [a0, lda0] = a_block(w, n, k, kpad, n0, pad[0]);
    const auto [a1, lda1] = n2 ? a_block(w, n, k, kpad, n0 + kTile, pad[1]) : std::pair{a0, lda0};
    for (int64_t mb = 0; mb < mblocks; mb += 2) {
      const bool m2 = mb + 1 < mblocks;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kc = 0; kc < kchunks; ++kc) {
        _tile_loadd(4, a0 + kc * kChunk, lda0);
        if (n2) _tile_loadd(5, a1 + kc * kChunk, lda1);
        for (int p = 0; p < 3; ++p) {
          const uint16_t* b = parts + p * part + mb * bstep + kc * kTile * kTile * 2;
          _tile_loadd(6, b, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (n2) _tile_dpbf16ps(2, 5, 6);
          if (m2) {
            _tile_loadd(7, b + bstep, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (n2) _tile_dpbf16ps(3, 5, 7);
          }
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int t = 0; t < 4; ++t) {  // tile t: weight block t / 2, activation block t % 2
        const int64_t nb = n0 + (t / 2) * kTile, mrow = (mb + t % 2) * kTile;
        if (nb >= n || mrow >= m) continue;
        const int64_t nr = std::min<int64_t>(kTile, n - nb);
        for (int64_t i = 0; i < kTile && mrow + i < m; ++i) {
          float* yr = y + (mrow + i) * ldy + nb;
          for (int64_t r = 0; r < nr; ++r) yr[r] = bias ? c[t][r * kTile + i] + bias[nb + r] : c[t][r * kTile + i];
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv is allowed
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // Linux: ask for the tile data once per process
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

int64_t amx_min_rows(int64_t set) {
  if (set >= 1) min_rows.store(set);
  return min_rows.load();
}

bool amx_rows(int64_t m) { return m >= min_rows.load() && active_isa() == Isa::avx512 && amx_usable(); }

void amx_linear(const float* x, int64_t m, int64_t k, const c10::BFloat16* w, int64_t n, const float* bias, float* y,
                int64_t ldy) {
  const int64_t mblocks = (m + kTile - 1) / kTile, kpairs = (k + kChunk - 1) / kChunk * kTile;
  std::vector<uint16_t> parts(static_cast<size_t>(3 * mblocks * kpairs * kTile * 2));
  pack_parts(x, m, k, mblocks, kpairs, parts.data());
  const auto* wb = reinterpret_cast<const uint16_t*>(w);
  const int64_t nblocks = (n + 2 * kTile - 1) / (2 * kTile);  // pairs of 16-row weight blocks
  at::parallel_for(0, nblocks, grain_for(nblocks, n * k * m),
                   [&](int64_t b0, int64_t b1) { blocks(parts.data(), m, k, wb, n, bias, y, ldy, b0, b1); });
}

}  // namespace mtp
