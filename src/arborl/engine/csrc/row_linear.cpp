// y = x @ W.T (+ bias) (+ residual) for the few rows of a decode or draft-verify step
// (arborl.engine.row_linear).
//
// At 1-24 rows a projection is bound by reading its weight, which oneDNN's blocked GEMM re-reads per
// block of 3-4 rows: its cost steps up with the row count, so a verify step of 4-8 draft rows cost
// up to 1.5x a decode step. Here the weight is stored once in panels of 16 output columns
// ([panels, K, 16], contiguous) and every panel is streamed once for all rows, in register blocks of
// at most 6 rows (12 accumulators + 2 weight registers + 1 broadcast: AVX2's 16). Each output is one
// fused multiply-add chain over k = 0..K-1 in order, whatever the row count or the row's block, so a
// row's result is bitwise the same alone or beside others.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ARBORL_ROW_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int kRowBlock = 6;

constexpr int64_t kChunk = 256;     // k per pass when rows take several blocks: 16 KB of panel, held in L1
constexpr int64_t kPrefetch = 128;  // panel rows (64 B each) fetched ahead of the FMAs: memory and compute overlap

// acc[r][0:16] += x[r, 0:kc] @ panel[0:kc] for the rows r < MB of one register block (acc zeroed first
// when ``first``). A chunk resumes exactly where the last stopped: one chain per output over all k.
template <int MB>
void block_chunk(const float* x, int64_t ldx, const float* panel, int64_t kc, float* acc, bool first) {
#ifdef ARBORL_ROW_AVX2
  // named accumulators, not an array: GCC kept an array's 12 registers in memory, storing each on every k
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define ARBORL_ROW_LOAD(r)                                        \
  if constexpr (MB > r) {                                         \
    c##r##0 = _mm256_loadu_ps(acc + r * kPanel);                  \
    c##r##1 = _mm256_loadu_ps(acc + r * kPanel + 8);              \
  }
#define ARBORL_ROW_FMA(r)                                         \
  if constexpr (MB > r) {                                         \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);       \
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
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * kPanel), _MM_HINT_T0);  // never faults
    const __m256 w0 = _mm256_load_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_load_ps(panel + k * kPanel + 8);
    ARBORL_ROW_FMA(0) ARBORL_ROW_FMA(1) ARBORL_ROW_FMA(2) ARBORL_ROW_FMA(3) ARBORL_ROW_FMA(4) ARBORL_ROW_FMA(5)
  }
  ARBORL_ROW_STORE(0) ARBORL_ROW_STORE(1) ARBORL_ROW_STORE(2) ARBORL_ROW_STORE(3) ARBORL_ROW_STORE(4) ARBORL_ROW_STORE(5)
#undef ARBORL_ROW_LOAD
#undef ARBORL_ROW_FMA
#undef ARBORL_ROW_STORE
#else
  if (first)
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < kPanel; ++j) acc[r * kPanel + j] = 0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MB; ++r) {
      const float xv = x[r * ldx + k];
      for (int j = 0; j < kPanel; ++j) acc[r * kPanel + j] = std::fma(xv, panel[k * kPanel + j], acc[r * kPanel + j]);
    }
#endif
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);
constexpr BlockFn kBlockFns[kRowBlock + 1] = {nullptr,          block_chunk<1>, block_chunk<2>, block_chunk<3>,
                                              block_chunk<4>, block_chunk<5>, block_chunk<6>};

at::Tensor row_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n_out, const c10::optional<at::Tensor>& bias_in,
                      const c10::optional<at::Tensor>& residual_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "row_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "row_linear: panels must be a contiguous float32 [panels, K, 16] tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "row_linear: x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel, "row_linear: ", P, " panels cannot hold ", n_out, " outputs");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr<float>()) % 32 == 0, "row_linear: panels must be 32-byte aligned");
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
  const float* bd = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float* rd = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* xd = x.data_ptr<float>();
  const float* wd = panels.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  // rows split into ceil(M / 6) blocks of near-equal size (8 rows: 4 + 4, not 6 + 2: no short chains);
  // with several blocks, k runs in L1-sized chunks so every block reuses the chunk just fetched. Neither
  // split changes a result: each output is one chain over k = 0..K-1 in order.
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t chunk = blocks == 1 ? K : kChunk;
  at::parallel_for(0, P, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wd + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        int64_t row = 0;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t rows = (M - row) / (blocks - b);
          kBlockFns[rows](xd + row * K + k0, K, panel + k0 * kPanel, kc, acc.data() + row * kPanel, k0 == 0);
          row += rows;
        }
      }
      const int64_t col = p * kPanel, width = std::min(kPanel, n_out - col);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t j = 0; j < width; ++j) {
          float v = acc[r * kPanel + j];
          if (bd) v += bd[col + j];
          if (rd) v += rd[r * n_out + col + j];
          yd[r * n_out + col + j] = v;
        }
    }
  });
  return y;
}

}  // namespace


TORCH_LIBRARY_FRAGMENT(arborl, m) {
  m.def("row_linear(Tensor x, Tensor panels, int n_out, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborl, CPU, m) {
  m.impl("row_linear", &row_linear);
}
