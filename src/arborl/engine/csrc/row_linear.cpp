// y = x @ W.T (+ bias) (+ residual) for the few rows of a decode or draft-verify step
// (arborl.engine.row_linear).
//
// At 1-32 rows a projection is bound by reading its weight, which oneDNN's blocked GEMM re-reads per
// block of 3-4 rows: its cost steps up with the row count, so a verify step of 4-8 draft rows cost
// up to 1.5x a decode step. Here the weight is stored once in panels of 16 output columns and every
// panel is streamed once for all rows, in register blocks of rows (AVX2: 6 rows, 12 accumulators;
// AVX-512: 16 rows, one zmm accumulator each). Each output is one multiply-add chain over k in order,
// whatever the row count, the row's block or the instruction set, so a row's result is bitwise the
// same alone or beside others, and the same on the scalar, AVX2 and AVX-512F paths (isa.h).
//
// Two panel formats:
// * float32 [panels, K, 16]: fused multiply-adds in float32;
// * bfloat16 [panels, ceil(K/2), 32] (pairs of k per output, the layout of AVX512-BF16's vdpbf16ps):
//   x is rounded to bfloat16 (nearest even) and each output accumulates in float32 one pair of k at a
//   time (the products of two bf16 are exact in float32). Half the bytes of weight per step and twice
//   the multiply-adds per instruction of float32 FMA; the scalar path is the reference.
// * int8 [panels, ceil(K/4), 64] (quads of k per output, the layout of AVX512-VNNI's vpdpbusd), each
//   weight stored plus 128 (unsigned), with a float32 scale per output (``scales``): every x row is
//   quantised to int8 with its own scale (max |x_r| / 127, rounded to nearest even), the products are
//   summed exactly in int32 (less 128 x the row's sum, the offset's share) and the sum is scaled back:
//   y = float(sum) * scale_r * scale_o. Exact sums and a scale per row make a row's result the same
//   alone or beside any rows, on every path (integer sums do not depend on their order). A quarter of
//   the bytes of float32 weight and 4x the multiply-adds per instruction (VNNI) of float32 FMA.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "numerics.h"

namespace {

using arborl::isa;

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 64;      // k (or k pairs) per pass when rows take several blocks: 4 KB of panel and of each block's x, in L1
// panel rows (64 B each) fetched ahead of the multiply-adds, into L2: at 1-8 rows (bound by streaming
// the weights) 0-10% faster than into L1, where the hints' misses queue behind the loads'
constexpr int64_t kPrefetch = 128;

// One register block of MB rows over one chunk of k: acc[r][0:16] += x[0:kc, r] @ panel[0:kc] (acc
// zeroed first when ``first``). A chunk resumes exactly where the last stopped: one chain per output.
// x is the block's rows packed k-major, [kc, MB], so a k's MB values are one cache line (at 16 rows)
// rather than MB lines: float32 panels: x float; bf16 panels: x = bf16 pairs as uint32, kc pairs.
using BlockFn = void (*)(const void* x, const void* panel, int64_t kc, float* acc, bool first);

template <int MB>
void block_scalar(const void* xv, const void* pv, int64_t kc, float* acc, bool first) {
  const float* x = static_cast<const float*>(xv);
  const float* panel = static_cast<const float*>(pv);
  if (first) std::fill(acc, acc + MB * kPanel, 0.0f);
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MB; ++r) {
      const float xk = x[k * MB + r];
      for (int j = 0; j < kPanel; ++j) acc[r * kPanel + j] = std::fma(xk, panel[k * kPanel + j], acc[r * kPanel + j]);
    }
}

// int8 panels: x = a row's quad of k as 4 int8 in a uint32 (k first in the lowest byte), panel rows of
// 16 outputs x 4 k unsigned bytes (weight + 128); acc holds int32 sums
template <int MB>
void block_i8_scalar(const void* xv, const void* pv, int64_t kc, float* accf, bool first) {
  const uint32_t* x = static_cast<const uint32_t*>(xv);
  const uint8_t* panel = static_cast<const uint8_t*>(pv);
  int32_t* acc = reinterpret_cast<int32_t*>(accf);
  if (first) std::fill(acc, acc + MB * kPanel, 0);
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MB; ++r) {
      const uint32_t quad = x[k * MB + r];
      for (int j = 0; j < kPanel; ++j) {
        int32_t sum = acc[r * kPanel + j];
        for (int t = 0; t < 4; ++t)
          sum += static_cast<int32_t>(panel[(k * kPanel + j) * 4 + t]) * static_cast<int8_t>(quad >> (8 * t));
        acc[r * kPanel + j] = sum;
      }
    }
}

// bf16 -> float as vdpbf16ps reads it: subnormals are zero (DAZ)
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = (b & 0x7f80u) ? static_cast<uint32_t>(b) << 16 : static_cast<uint32_t>(b & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// the reference of vdpbf16ps (Intel's definition, which this AMD CPU matches bitwise): per output,
// acc += x[2k+1] * w[2k+1], then acc += x[2k] * w[2k], each sum rounded to nearest even (the products
// of two bf16 are exact), subnormal inputs and results zero
inline float ftz(float a) { return std::fabs(a) < 1.17549435e-38f ? 0.0f * a : a; }

template <int MB>
void block_bf16_scalar(const void* xv, const void* pv, int64_t kc, float* acc, bool first) {
  const uint32_t* x = static_cast<const uint32_t*>(xv);
  const uint16_t* panel = static_cast<const uint16_t*>(pv);
  if (first) std::fill(acc, acc + MB * kPanel, 0.0f);
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MB; ++r) {
      const uint32_t pair = x[k * MB + r];
      const float x0 = bf16_to_float(pair & 0xffff), x1 = bf16_to_float(pair >> 16);
      for (int j = 0; j < kPanel; ++j) {
        float a = acc[r * kPanel + j];
        a = ftz(a + x1 * bf16_to_float(panel[(k * kPanel + j) * 2 + 1]));
        a = ftz(a + x0 * bf16_to_float(panel[(k * kPanel + j) * 2]));
        acc[r * kPanel + j] = a;
      }
    }
}

#ifdef ARBORL_X86
// named accumulators, not an array: GCC kept an array's registers in memory, storing each on every k
template <int MB>
ARBORL_TARGET_AVX2 void block_avx2(const void* xv, const void* pv, int64_t kc, float* acc, bool first) {
  const float* x = static_cast<const float*>(xv);
  const float* panel = static_cast<const float*>(pv);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define ARBORL_ROW_LOAD(r)                                        \
  if constexpr (MB > r) {                                         \
    c##r##0 = _mm256_loadu_ps(acc + r * kPanel);                  \
    c##r##1 = _mm256_loadu_ps(acc + r * kPanel + 8);              \
  }
#define ARBORL_ROW_FMA(r)                                         \
  if constexpr (MB > r) {                                         \
    const __m256 xb = _mm256_broadcast_ss(x + k * MB + r);       \
    c##r##0 = _mm256_fmadd_ps(xb, w0, c##r##0);                   \
    c##r##1 = _mm256_fmadd_ps(xb, w1, c##r##1);                   \
  }
#define ARBORL_ROW_STORE(r)                                       \
  if constexpr (MB > r) {                                         \
    _mm256_storeu_ps(acc + r * kPanel, c##r##0);                  \
    _mm256_storeu_ps(acc + r * kPanel + 8, c##r##1);              \
  }
  if (!first) {
    ARBORL_ROW_LOAD(0) ARBORL_ROW_LOAD(1) ARBORL_ROW_LOAD(2) ARBORL_ROW_LOAD(3) ARBORL_ROW_LOAD(4) ARBORL_ROW_LOAD(5)
  }
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * kPanel), _MM_HINT_T1);  // never faults
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    ARBORL_ROW_FMA(0) ARBORL_ROW_FMA(1) ARBORL_ROW_FMA(2) ARBORL_ROW_FMA(3) ARBORL_ROW_FMA(4) ARBORL_ROW_FMA(5)
  }
  ARBORL_ROW_STORE(0) ARBORL_ROW_STORE(1) ARBORL_ROW_STORE(2) ARBORL_ROW_STORE(3) ARBORL_ROW_STORE(4) ARBORL_ROW_STORE(5)
#undef ARBORL_ROW_LOAD
#undef ARBORL_ROW_FMA
#undef ARBORL_ROW_STORE
}

// int8 without VNNI: 4 outputs' 4 k widened to 16-bit (vpmaddwd: exact 32-bit sums of pairs), two
// partial sums per output folded at the end of the chunk; 3 rows (12 accumulators)
template <int MB>
ARBORL_TARGET_AVX2 void block_i8_avx2(const void* xv, const void* pv, int64_t kc, float* accf, bool first) {
  const int32_t* x = static_cast<const int32_t*>(xv);
  const uint8_t* panel = static_cast<const uint8_t*>(pv);
  int32_t* acc = reinterpret_cast<int32_t*>(accf);
  __m256i a[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int g = 0; g < 4; ++g) a[r][g] = _mm256_setzero_si256();
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + k * 64) + kPrefetch * 64, _MM_HINT_T1);
    __m256i xr[MB];
    for (int r = 0; r < MB; ++r) xr[r] = _mm256_cvtepi8_epi16(_mm_set1_epi32(x[k * MB + r]));  // [x0..x3] x 4
    for (int g = 0; g < 4; ++g) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * 64 + 16 * g)));
      for (int r = 0; r < MB; ++r) a[r][g] = _mm256_add_epi32(a[r][g], _mm256_madd_epi16(w, xr[r]));
    }
  }
  for (int r = 0; r < MB; ++r) {
    // a[r][g] = [o0 o0 o1 o1 | o2 o2 o3 o3] of outputs 4g..4g+3: pairs added, then lanes in output order
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[r][0], a[r][1]), _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[r][2], a[r][3]), _MM_SHUFFLE(3, 1, 2, 0));
    __m256i* out = reinterpret_cast<__m256i*>(acc + r * kPanel);
    if (first) {
      _mm256_storeu_si256(out, lo);
      _mm256_storeu_si256(out + 1, hi);
    } else {
      _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), lo));
      _mm256_storeu_si256(out + 1, _mm256_add_epi32(_mm256_loadu_si256(out + 1), hi));
    }
  }
}

// AVX-512: a panel's 16 columns are one zmm register, so a block holds 16 rows (16 accumulators)
#define ARBORL_ROWS16(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define ARBORL_ZDECL(r) __m512 c##r = _mm512_setzero_ps();
#define ARBORL_ZLOAD(r) \
  if constexpr (MB > r) c##r = _mm512_loadu_ps(acc + r * kPanel);
#define ARBORL_ZSTORE(r) \
  if constexpr (MB > r) _mm512_storeu_ps(acc + r * kPanel, c##r);

template <int MB>
ARBORL_TARGET_AVX512 void block_avx512(const void* xv, const void* pv, int64_t kc, float* acc, bool first) {
  const float* x = static_cast<const float*>(xv);
  const float* panel = static_cast<const float*>(pv);
  ARBORL_ROWS16(ARBORL_ZDECL)
  if (!first) {
    ARBORL_ROWS16(ARBORL_ZLOAD)
  }
#define ARBORL_ZFMA(r) \
  if constexpr (MB > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x[k * MB + r]), w, c##r);
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * kPanel), _MM_HINT_T1);
    const __m512 w = _mm512_loadu_ps(panel + k * kPanel);
    ARBORL_ROWS16(ARBORL_ZFMA)
  }
#undef ARBORL_ZFMA
  ARBORL_ROWS16(ARBORL_ZSTORE)
}

template <int MB>
ARBORL_TARGET_AVX512BF16 void block_bf16_avx512(const void* xv, const void* pv, int64_t kc, float* acc,
                                                bool first) {
  const int32_t* x = static_cast<const int32_t*>(xv);
  const uint16_t* panel = static_cast<const uint16_t*>(pv);
  ARBORL_ROWS16(ARBORL_ZDECL)
  if (!first) {
    ARBORL_ROWS16(ARBORL_ZLOAD)
  }
#define ARBORL_ZDOT(r) \
  if constexpr (MB > r) c##r = _mm512_dpbf16_ps(c##r, (__m512bh)_mm512_set1_epi32(x[k * MB + r]), w);
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * 2 * kPanel), _MM_HINT_T1);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kPanel);
    ARBORL_ROWS16(ARBORL_ZDOT)
  }
#undef ARBORL_ZDOT
  ARBORL_ROWS16(ARBORL_ZSTORE)
}
// int8 on VNNI: vpdpbusd adds each output's 4 products (unsigned weight byte x signed x byte) in int32
#define ARBORL_IDECL(r) __m512i c##r = _mm512_setzero_si512();
#define ARBORL_ILOAD(r) \
  if constexpr (MB > r) c##r = _mm512_loadu_si512(acc + r * kPanel);
#define ARBORL_ISTORE(r) \
  if constexpr (MB > r) _mm512_storeu_si512(acc + r * kPanel, c##r);
template <int MB>
ARBORL_TARGET_AVX512VNNI void block_i8_vnni(const void* xv, const void* pv, int64_t kc, float* accf, bool first) {
  const int32_t* x = static_cast<const int32_t*>(xv);
  const uint8_t* panel = static_cast<const uint8_t*>(pv);
  int32_t* acc = reinterpret_cast<int32_t*>(accf);
  ARBORL_ROWS16(ARBORL_IDECL)
  if (!first) {
    ARBORL_ROWS16(ARBORL_ILOAD)
  }
#define ARBORL_IDOT(r) \
  if constexpr (MB > r) c##r = _mm512_dpbusd_epi32(c##r, w, _mm512_set1_epi32(x[k * MB + r]));
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + k * 64) + kPrefetch * 64, _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(panel + k * 64);
    ARBORL_ROWS16(ARBORL_IDOT)
  }
#undef ARBORL_IDOT
  ARBORL_ROWS16(ARBORL_ISTORE)
}
#undef ARBORL_IDECL
#undef ARBORL_ILOAD
#undef ARBORL_ISTORE
#undef ARBORL_ZDECL
#undef ARBORL_ZLOAD
#undef ARBORL_ZSTORE
#undef ARBORL_ROWS16
#endif

#define ARBORL_TABLE3(fn) {nullptr, fn<1>, fn<2>, fn<3>}
#define ARBORL_TABLE6(fn) {nullptr, fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>}
#define ARBORL_TABLE16(fn) \
  {nullptr, fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>, fn<7>, fn<8>, fn<9>, fn<10>, fn<11>, fn<12>, fn<13>, fn<14>, fn<15>, fn<16>}

const BlockFn kFnScalar[] = ARBORL_TABLE6(block_scalar);
const BlockFn kFnBf16Scalar[] = ARBORL_TABLE6(block_bf16_scalar);
const BlockFn kFnI8Scalar[] = ARBORL_TABLE6(block_i8_scalar);
#ifdef ARBORL_X86
const BlockFn kFnI8Avx2[] = ARBORL_TABLE3(block_i8_avx2);
const BlockFn kFnI8Vnni[] = ARBORL_TABLE16(block_i8_vnni);
const BlockFn kFnAvx2[] = ARBORL_TABLE6(block_avx2);
const BlockFn kFnAvx512[] = ARBORL_TABLE16(block_avx512);
const BlockFn kFnBf16Avx512[] = ARBORL_TABLE16(block_bf16_avx512);
#endif

enum class Panels { kF32, kBf16, kI8 };

// the block functions (indexed by rows, 1..max) of the current path for the panels' format
std::pair<const BlockFn*, int> path(Panels kind) {
  const int level = isa();
#ifdef ARBORL_X86
  if (kind == Panels::kBf16)
    return level >= arborl::kAvx512Bf16 ? std::make_pair(kFnBf16Avx512, 16) : std::make_pair(kFnBf16Scalar, 6);
  if (kind == Panels::kI8) {
    static const bool vnni = arborl::cpu_has_vnni();
    if (level >= arborl::kAvx512 && vnni) return {kFnI8Vnni, 16};
    if (level >= arborl::kAvx2) return {kFnI8Avx2, 3};
    return {kFnI8Scalar, 6};
  }
  if (level >= arborl::kAvx512) return {kFnAvx512, 16};
  if (level >= arborl::kAvx2) return {kFnAvx2, 6};
#else
  if (kind == Panels::kBf16) return {kFnBf16Scalar, 6};
  if (kind == Panels::kI8) return {kFnI8Scalar, 6};
#endif
  return {kFnScalar, 6};
}

at::Tensor row_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n_out, const c10::optional<at::Tensor>& bias_in,
                      const c10::optional<at::Tensor>& residual_in, const c10::optional<at::Tensor>& scales_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "row_linear: x must be a 2-d float32 CPU tensor");
  const bool bf16 = panels.scalar_type() == at::kBFloat16, i8 = panels.scalar_type() == at::kByte;
  const Panels kind = bf16 ? Panels::kBf16 : i8 ? Panels::kI8 : Panels::kF32;
  const int64_t width = bf16 ? 2 * kPanel : i8 ? 4 * kPanel : kPanel;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == width && (bf16 || i8 || panels.scalar_type() == at::kFloat) && panels.is_contiguous(),
              "row_linear: panels must be a contiguous float32 [panels, K, 16], bfloat16 [panels, ceil(K/2), 32] "
              "or uint8 [panels, ceil(K/4), 64] tensor");
  TORCH_CHECK(i8 == scales_in.has_value(), "row_linear: int8 panels take a scale per output (scales), other panels none");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const int64_t per_row = bf16 ? 2 : i8 ? 4 : 1;  // k per panel row
  const int64_t Kp = (K + per_row - 1) / per_row;  // panel rows: k, pairs or quads of k
  TORCH_CHECK(panels.size(1) == Kp, "row_linear: x has ", K, " features, the weight ", per_row * panels.size(1));
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel, "row_linear: ", P, " panels cannot hold ", n_out, " outputs");
  at::Tensor bias, residual;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.numel() == n_out && bias.scalar_type() == at::kFloat, "row_linear: bias must hold ", n_out, " floats");
  }
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.dim() == 2 && residual.size(0) == M && residual.size(1) == n_out && residual.scalar_type() == at::kFloat,
                "row_linear: residual must be float32 [", M, ", ", n_out, "]");
  }
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  at::Tensor scales;
  if (i8) {
    scales = scales_in->contiguous();
    TORCH_CHECK(scales.numel() == n_out && scales.scalar_type() == at::kFloat, "row_linear: scales must hold ", n_out, " floats");
  }
  const float* bd = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float* rd = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const auto [fns, max_rows] = path(kind);
  // rows split into ceil(M / max_rows) blocks of near-equal size (8 rows at 6: 4 + 4, not 6 + 2); with
  // several blocks, k runs in L1-sized chunks so every block reuses the chunk just fetched. Neither
  // split changes a result: each output is one chain over k in order.
  const int64_t blocks = (M + max_rows - 1) / max_rows;
  const int64_t chunk = blocks == 1 ? Kp : kChunk;
  std::vector<int64_t> block_row(blocks + 1, 0);
  for (int64_t b = 0; b < blocks; ++b) block_row[b + 1] = block_row[b] + (M - block_row[b]) / (blocks - b);
  // x packed once, block by block, k-major ([Kp, rows of the block]), 4 bytes per value: floats, or
  // for bf16 panels pairs of k rounded to bf16 (nearest even; an odd K padded with a zero), rounded
  // row-major first (a loop that vectorises). Split over threads from 64 rows (a prefill).
  const float* xf = x.data_ptr<float>();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(xf);
  std::vector<uint32_t> rounded;
  if (bf16) {
    rounded.assign(M * Kp, 0u);
    uint16_t* half = reinterpret_cast<uint16_t*>(rounded.data());
    at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t k = 0; k < K; ++k) half[r * 2 * Kp + k] = arborl::bf16_round(xf[r * K + k]);
    });
    src = rounded.data();
  }
  // int8: each row quantised with its own scale (as quantize.int8_rows: max |x_r| / 127, at least 1e-12,
  // nearest even, within +-127), k padded to quads with zeros; each row's sum of its int8 values kept
  std::vector<float> row_scale;
  std::vector<int32_t> row_sum;
  if (i8) {
    rounded.assign(M * Kp, 0u);
    row_scale.assign(M, 0.0f);
    row_sum.assign(M, 0);
    int8_t* q = reinterpret_cast<int8_t*>(rounded.data());
    at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = xf + r * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
        const float scale = std::max(amax / 127.0f, 1e-12f);
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          const float v = std::min(std::max(std::nearbyint(row[k] / scale), -127.0f), 127.0f);
          q[r * 4 * Kp + k] = static_cast<int8_t>(v);
          sum += static_cast<int32_t>(v);
        }
        row_scale[r] = scale;
        row_sum[r] = sum;
      }
    });
    src = rounded.data();
  }
  std::vector<uint32_t> xpack(M * Kp);
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = block_row[b], rows = block_row[b + 1] - r0;
      uint32_t* dst = xpack.data() + r0 * Kp;
      for (int64_t k = 0; k < Kp; ++k)
        for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = src[(r0 + r) * Kp + k];
    }
  });
  const char* wd = static_cast<const char*>(panels.data_ptr());
  const int64_t wstride = 64;  // bytes per panel row: 16 floats, 16 pairs of bf16 or 16 quads of int8
  const float* sd = i8 ? scales.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, P, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const char* panel = wd + p * Kp * wstride;
      for (int64_t k0 = 0; k0 < Kp; k0 += chunk) {
        const int64_t kc = std::min(chunk, Kp - k0);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t r0 = block_row[b], rows = block_row[b + 1] - r0;
          fns[rows](xpack.data() + r0 * Kp + k0 * rows, panel + k0 * wstride, kc, acc.data() + r0 * kPanel, k0 == 0);
        }
      }
      const int64_t col = p * kPanel, cols = std::min(kPanel, n_out - col);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          float v = acc[r * kPanel + j];
          if (sd) {  // int32 sums: less the offset's share (128 x the row's sum), then both scales
            int32_t sum;
            std::memcpy(&sum, &acc[r * kPanel + j], sizeof(sum));
            // volatile: rounded here, never fused with the bias's add into one multiply-add (as
            // quantize.Int8Linear computes it, in two steps)
            const volatile float scaled = static_cast<float>(sum - 128 * row_sum[r]) * row_scale[r] * sd[col + j];
            v = scaled;
          }
          if (bd) v += bd[col + j];
          if (rd) v += rd[r * n_out + col + j];
          yd[r * n_out + col + j] = v;
        }
    }
  });
  return y;
}

// the kernels' path: "" = leave it; "auto" = the best this CPU has; or a path name it has.
// Returns [the path now, every path this CPU has, lowest first].
std::vector<std::string> kernel_isa(const std::string& want) {
  const int best = arborl::cpu_isa();
  if (!want.empty()) {
    int level = -1;
    if (want == "auto") level = best;
    for (int i = 0; i <= best; ++i)
      if (want == arborl::kIsaNames[i]) level = i;
    TORCH_CHECK(level >= 0, "kernel_isa: this CPU runs ", arborl::kIsaNames[best], " at most; ", want, " is not one of its paths");
    arborl::isa_state().store(level);
  }
  std::vector<std::string> out{arborl::kIsaNames[isa()]};
  for (int i = 0; i <= best; ++i) out.emplace_back(arborl::kIsaNames[i]);
  return out;
}

}  // namespace


TORCH_LIBRARY_FRAGMENT(arborl, m) {
  m.def("row_linear(Tensor x, Tensor panels, int n_out, Tensor? bias=None, Tensor? residual=None, Tensor? scales=None) -> Tensor");
  m.def("kernel_isa(str want) -> str[]", &kernel_isa);
}

TORCH_LIBRARY_IMPL(arborl, CPU, m) {
  m.impl("row_linear", &row_linear);
}
