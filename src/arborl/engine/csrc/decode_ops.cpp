// The element-wise steps of a decoder layer between its GEMMs, one pass each
// (arborl.engine.packed_forward): RMSNorm, the rotary embedding of q and k in place, and SiLU(gate) *
// up. As torch ops these were ~13 dispatches per layer, each with its own pass over memory and
// thread start: ~10 of the 84 ms of a batch-32 decode step of SmolLM2-135M on 2 cores (profiled).
// Rows are split over threads only when there are enough of them (a prefill); a row's result never
// depends on the split.
//
// The rotary embedding is q*cos + rotate_half(q)*sin with each product rounded (no fused multiply-add),
// bitwise torch's; RMSNorm and SiLU agree with torch's to float rounding (their sums and exp differ in
// order and polynomial).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "numerics.h"

namespace {

constexpr int64_t kRowsPerTask = 64;  // below this, one thread: a decode step's rows
constexpr int64_t kSiluRowsPerTask = 8;  // SiLU * up: 8 rows of an MLP's width are worth a thread

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(1) == 1,
              op, ": ", name, " must be a float32 CPU matrix with contiguous rows");
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight_in, double eps) {
  check_rows(x, "rms_norm", "x");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t N = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == H, "rms_norm: weight must hold ", H, " floats");
  at::Tensor out = at::empty({N, H}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xd + r * ldx;
      float part[16] = {0};
      int64_t d = 0;
      for (; d + 16 <= H; d += 16)
        for (int u = 0; u < 16; ++u) part[u] += row[d + u] * row[d + u];
      for (int w2 = 8; w2 > 0; w2 /= 2)
        for (int u = 0; u < w2; ++u) part[u] += part[u + w2];
      float sum = part[0];
      for (; d < H; ++d) sum += row[d] * row[d];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      float* o = od + r * H;
      for (int64_t j = 0; j < H; ++j) o[j] = row[j] * inv * w[j];
    }
  });
  return out;
}

// Rows [begin, end) of rotary_: every product rounded before the sum, as torch computes it. A named
// function with its own contraction setting (a lambda would take its caller's, which GCC then fuses).
__attribute__((optimize("fp-contract=off"), noinline)) void rotary_rows(float* xd, int64_t ldx, const float* cd,
                                                                        const float* sd, int64_t D, int64_t heads,
                                                                        int64_t begin, int64_t end) {
  const int64_t half = D / 2;
  for (int64_t r = begin; r < end; ++r) {
    const float* c = cd + r * D;
    const float* s = sd + r * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = xd + r * ldx + h * D;
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        const float lo = a * c[j] + (-b) * s[j];
        const float hi = b * c[j + half] + a * s[j + half];
        v[j] = lo;
        v[j + half] = hi;
      }
    }
  }
}

// In place on the first `heads` heads of each row of x [N, >= heads * D]: x = x*cos + rotate_half(x)*sin,
// cos and sin [N, D] (each row's position), rotate_half(x) = [-x[D/2:], x[:D/2]].
void rotary_(at::Tensor x, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t heads) {
  check_rows(x, "rotary_", "x");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  check_rows(cos, "rotary_", "cos");
  check_rows(sin, "rotary_", "sin");
  const int64_t N = x.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == N && sin.sizes() == cos.sizes(), "rotary_: cos and sin must be [", N, ", even D]");
  TORCH_CHECK(heads > 0 && heads * D <= x.size(1), "rotary_: ", heads, " heads of ", D, " do not fit a row of ", x.size(1));
  float* xd = x.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) { rotary_rows(xd, ldx, cd, sd, D, heads, begin, end); });
}

// [N, 2I] (gate | up) -> [N, I]: silu(gate) * up, silu(g) = g / (1 + exp(-g))
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even width (gate | up)");
  at::Tensor out = at::empty({N, I}, gate_up.options());
  const float* gd = gate_up.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t ld = gate_up.stride(0);
  at::parallel_for(0, N, kSiluRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict g = gd + r * ld;
      const float* __restrict u = g + I;
      float* __restrict o = od + r * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + arborl::exp_poly(-g[j])) * u[j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborl, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()", &rotary_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}
