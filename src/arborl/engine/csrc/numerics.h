// Float helpers every kernel of arborl's CPU library shares (arborl.engine.cpu_kernels): bfloat16
// rounding and widening, and an exp whose loops vectorise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace arborl {

// float -> bfloat16, rounded to nearest even as torch rounds (NaN stays NaN); branch-free, so the
// loops that call it vectorise
inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0) : rounded;
}

// bfloat16 -> float, exactly
inline float bf16_widen(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x), Cephes' expf polynomial, x clamped to [-87.3, 88.3]; branch-free so the loops that call it
// vectorise (with -fno-trapping-math); within 2 ulp of std::exp
inline float exp_poly(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace arborl
