// Decode and tree-verify attention for the CPU engine (arborl.engine.tree_attention).
//
// Every query row walks its keys in logical order (the slot's prefix [0, prefix), then its own
// listed positions, e.g. the ancestors of a draft node) with one fixed loop, whatever the batch,
// the padded length or the other rows. So a token's attention output is bitwise the same decoded
// alone, decoded in a batch of 32, or verified as a node of a draft tree: speculative decoding then
// records exactly the log-probs plain decoding does. The q heads that share a KV head are done in
// one pass over that head's keys (GQA without repeating K/V).
//
// The cache is float32, or bfloat16 (the CPU bf16 rollout: half the bytes a step reads; each key and
// value widened to float32 exactly as it is loaded, every sum float32, the row's own K/V rounded to
// nearest even as it is written).
//
// Paths per instruction set (isa.h), chosen at run time: scalar, AVX2 and AVX-512F. The weighted sum
// of V is one fused multiply-add chain per element on every path (bitwise equal); the q.k scores sum
// 8 (AVX2) or 16 (AVX-512) lanes before a fixed reduction tree, so they agree to float rounding
// (~1e-7) across paths and bitwise within one.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "numerics.h"

namespace {

constexpr int kLanes = 16;

using bf16_t = uint16_t;

inline float widen(float v) { return v; }
inline float widen(bf16_t v) { return arborl::bf16_widen(v); }

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int u = 0; u < kLanes; ++u) acc[u] = std::fma(a[d + u], widen(b[d + u]), acc[u]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
  float s = acc[0];
  // an explicit fma: left to the compiler (GCC contracts a*b+c at will), the float and the bfloat16
  // instantiations of this tail rounded differently on some machines (head dim 40, Intel Xeon)
  for (; d < n; ++d) s = std::fma(a[d], widen(b[d]), s);
  return s;
}

// scores[j] = scale * q . K[keys[j]] for j < L. The grouping of keys (blocks of 8, then single keys)
// depends on j and L only, so a row's scores never depend on other rows.
template <typename T>
void scores_scalar(const float* q, const T* kbase, const int64_t* keys, int64_t L, int64_t D, float scale,
                   float* scores) {
  for (int64_t j = 0; j < L; ++j) scores[j] = dot(q, kbase + keys[j] * D, D) * scale;
}

// acc[:D] += sum_j p[j] * V[keys[j]], j in order: one fused multiply-add chain per element, every path
template <typename T>
void weighted_sum_scalar(const float* p, const T* vbase, const int64_t* keys, int64_t L, int64_t D, float* acc) {
  for (int64_t j = 0; j < L; ++j) {
    const T* v = vbase + keys[j] * D;
    for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(p[j], widen(v[d]), acc[d]);
  }
}

#ifdef ARBORL_X86
ARBORL_TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
ARBORL_TARGET_AVX2 inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
ARBORL_TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ARBORL_TARGET_AVX512 inline __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <typename T>
ARBORL_TARGET_AVX2 void scores_avx2(const float* q, const T* kbase, const int64_t* keys, int64_t L, int64_t D,
                                    float scale, float* scores) {
  int64_t j = 0;
  if (D % 8 == 0) {
    for (; j + 8 <= L; j += 8) {
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, load8(kbase + keys[j + u] * D + d), a[u]);
      }
      // 8 accumulators -> one vector of 8 sums, key u in lane u
      const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
      const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
      const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
      _mm256_storeu_ps(scores + j, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
    }
  }
  for (; j < L; ++j) scores[j] = dot(q, kbase + keys[j] * D, D) * scale;
}

// The accumulator of N*8 floats stays in registers.
template <int N, typename T>
ARBORL_TARGET_AVX2 void weighted_sum_avx2(const float* p, const T* vbase, const int64_t* keys, int64_t L, float* acc) {
  __m256 a[N];
  for (int u = 0; u < N; ++u) a[u] = _mm256_loadu_ps(acc + 8 * u);
  for (int64_t j = 0; j < L; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const T* v = vbase + keys[j] * (8 * N);
    for (int u = 0; u < N; ++u) a[u] = _mm256_fmadd_ps(w, load8(v + 8 * u), a[u]);
  }
  for (int u = 0; u < N; ++u) _mm256_storeu_ps(acc + 8 * u, a[u]);
}

// every cache line of one cache row of D values, into L2 (a hint: never faults). A decode step reads
// every slot's whole cache (SmolLM2, 32 rows x ~100 keys: 159 MB in float32) in runs of a few KB that
// the hardware prefetchers barely start on: fetching the value rows during the scores and the next
// task's key rows during the weighted sum took 30 layers from 10-13 ms to 7-8 ms (bf16: 8-9 to 4.5-5);
// the same hints into L1 (prefetcht0) gained nothing, their misses queueing behind the loads'.
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// The AVX-512 path's scores, for the G query heads that share a KV head in one pass over its keys:
// 8 key rows at a time (a bf16 block widened once into ``wide``, exactly as load16 widens it); per
// head, 16 lanes of d per key, the 8 x 16 partial sums folded to 8 x 8 (lane i + lane i+8), then the
// AVX2 reduction tree. A head's scores do not depend on G or on the other heads.
template <typename T>
ARBORL_TARGET_AVX512 void scores_heads_avx512(const float* q, int64_t G, const T* kbase, const int64_t* keys, int64_t L,
                                              int64_t D, float scale, float* scores, float* wide, const T* vbase) {
  int64_t j = 0;
  if (D % 16 == 0) {
    for (; j + 8 <= L; j += 8) {
      const float* rows[8];
      for (int u = 0; u < 8; ++u) {
        prefetch_row(vbase + keys[j + u] * D, D);
        const T* src = kbase + keys[j + u] * D;
        if constexpr (std::is_same_v<T, float>) {
          rows[u] = src;
        } else {
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(wide + u * D + d, load16(src + d));
          rows[u] = wide + u * D;
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        const float* qh = q + h * D;
        __m512 a[8];
        for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qh + d);
          for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[u] + d), a[u]);
        }
        __m256 f[8];
        for (int u = 0; u < 8; ++u) f[u] = _mm256_add_ps(_mm512_castps512_ps256(a[u]), _mm512_extractf32x8_ps(a[u], 1));
        const __m256 h01 = _mm256_hadd_ps(f[0], f[1]), h23 = _mm256_hadd_ps(f[2], f[3]);
        const __m256 h45 = _mm256_hadd_ps(f[4], f[5]), h67 = _mm256_hadd_ps(f[6], f[7]);
        const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
        const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
        _mm256_storeu_ps(scores + h * L + j, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
      }
    }
  }
  for (; j < L; ++j)
    for (int64_t h = 0; h < G; ++h) scores[h * L + j] = dot(q + h * D, kbase + keys[j] * D, D) * scale;
}

// The AVX-512 path's weighted sum: acc[h, :16N] += sum_j p[h, j] * V[keys[j]] for H heads in one pass
// over V, each value row loaded (and widened) once for the H heads, every element one fused
// multiply-add chain over j in order (bitwise the scalar and AVX2 paths)
template <int N, int H, typename T>
ARBORL_TARGET_AVX512 void weighted_sum_heads_avx512(const float* p, int64_t L, const T* vbase, const int64_t* keys,
                                                    float* acc, const T* next, int64_t next_rows) {
  __m512 a[H][N];
  for (int h = 0; h < H; ++h)
    for (int u = 0; u < N; ++u) a[h][u] = _mm512_loadu_ps(acc + h * 16 * N + 16 * u);
  for (int64_t j = 0; j < L; ++j) {
    if (j < next_rows) prefetch_row(next + j * 16 * N, 16 * N);
    const T* v = vbase + keys[j] * (16 * N);
    __m512 row[N];
    for (int u = 0; u < N; ++u) row[u] = load16(v + 16 * u);
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * L + j]);
      for (int u = 0; u < N; ++u) a[h][u] = _mm512_fmadd_ps(w, row[u], a[h][u]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int u = 0; u < N; ++u) _mm512_storeu_ps(acc + h * 16 * N + 16 * u, a[h][u]);
}

// heads in groups that keep their accumulators in registers (at most 16 zmm)
template <int N, typename T>
ARBORL_TARGET_AVX512 void weighted_sum_heads_n(const float* p, int64_t G, int64_t L, const T* vbase, const int64_t* keys,
                                               float* acc, const T* next, int64_t next_rows) {
  constexpr int kMax = 16 / N > 4 ? 4 : 16 / N;
  for (int64_t h0 = 0; h0 < G; h0 += kMax) {
    const float* ph = p + h0 * L;
    float* ah = acc + h0 * 16 * N;
    const int64_t nr = h0 == 0 ? next_rows : 0;  // the next task's keys, fetched during the first pass
    switch (G - h0 >= kMax ? kMax : G - h0) {
      case 1: weighted_sum_heads_avx512<N, 1, T>(ph, L, vbase, keys, ah, next, nr); break;
      case 2: if constexpr (kMax >= 2) weighted_sum_heads_avx512<N, 2, T>(ph, L, vbase, keys, ah, next, nr); break;
      case 3: if constexpr (kMax >= 3) weighted_sum_heads_avx512<N, 3, T>(ph, L, vbase, keys, ah, next, nr); break;
      default: if constexpr (kMax >= 4) weighted_sum_heads_avx512<N, 4, T>(ph, L, vbase, keys, ah, next, nr); break;
    }
  }
}

// weighted_sum for all G heads at once, where D has a register-resident form (else false)
template <typename T>
inline bool weighted_sum_heads(const float* p, int64_t G, int64_t L, const T* vbase, const int64_t* keys, int64_t D,
                               float* acc, const T* next, int64_t next_rows) {
  switch (D) {
    case 64: weighted_sum_heads_n<4, T>(p, G, L, vbase, keys, acc, next, next_rows); return true;
    case 128: weighted_sum_heads_n<8, T>(p, G, L, vbase, keys, acc, next, next_rows); return true;
    case 32: weighted_sum_heads_n<2, T>(p, G, L, vbase, keys, acc, next, next_rows); return true;
    case 96: weighted_sum_heads_n<6, T>(p, G, L, vbase, keys, acc, next, next_rows); return true;
    default: return false;
  }
}
#endif

template <typename T>
inline void scores_row(const float* q, const T* kbase, const int64_t* keys, int64_t L, int64_t D, float scale,
                       float* scores, int level) {
#ifdef ARBORL_X86
  if (level >= arborl::kAvx2) return scores_avx2(q, kbase, keys, L, D, scale, scores);
#endif
  scores_scalar(q, kbase, keys, L, D, scale, scores);
}

template <typename T>
inline void weighted_sum(const float* p, const T* vbase, const int64_t* keys, int64_t L, int64_t D, float* acc,
                         int level) {
#ifdef ARBORL_X86
  if (level >= arborl::kAvx2) switch (D) {
      case 64: return weighted_sum_avx2<8, T>(p, vbase, keys, L, acc);
      case 128: return weighted_sum_avx2<16, T>(p, vbase, keys, L, acc);
      case 32: return weighted_sum_avx2<4, T>(p, vbase, keys, L, acc);
      case 96: return weighted_sum_avx2<12, T>(p, vbase, keys, L, acc);
      default: break;
    }
#endif
  weighted_sum_scalar(p, vbase, keys, L, D, acc);
}

void check(const at::Tensor& t, const char* name, int64_t dim, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == dim, "tree_attention: ", name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == dtype, "tree_attention: ", name, " has dtype ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "tree_attention: ", name, " must be on the CPU");
}

// q [R, Hq, D]; k_cache, v_cache [slots, Hkv, capacity, D] (last two dims contiguous);
// row_slot, prefix [R]; extra [R, E] slot positions attended after the prefix, -1 = none;
// optionally k_new, v_new [R, Hkv, D] and write_pos [R]: each row's own K/V, written to its slot first.
// Returns [R, Hq, D].
at::Tensor tree_attention(const at::Tensor& q_in, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& row_slot_in, const at::Tensor& prefix_in, const at::Tensor& extra_in,
                          double scale, const c10::optional<at::Tensor>& k_new_in,
                          const c10::optional<at::Tensor>& v_new_in, const c10::optional<at::Tensor>& write_pos_in) {
  check(q_in, "q", 3, at::kFloat);
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  check(k_cache, "k_cache", 4, bf16 ? at::kBFloat16 : at::kFloat);
  check(v_cache, "v_cache", 4, k_cache.scalar_type());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor row_slot = row_slot_in.to(at::kLong).contiguous();
  const at::Tensor prefix = prefix_in.to(at::kLong).contiguous();
  const at::Tensor extra = extra_in.to(at::kLong).contiguous();
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), C = k_cache.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "tree_attention: k_cache and v_cache differ in layout");
  TORCH_CHECK(k_cache.size(3) == D && k_cache.stride(3) == 1 && k_cache.stride(2) == D,
              "tree_attention: the cache's last two dims must be contiguous [capacity, head_dim]");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "tree_attention: ", Hq, " query heads over ", Hkv, " kv heads");
  TORCH_CHECK(row_slot.numel() == R && prefix.numel() == R && extra.dim() == 2 && extra.size(0) == R,
              "tree_attention: row_slot, prefix [R] and extra [R, E] must match q's ", R, " rows");
  const int64_t G = Hq / Hkv, E = extra.size(1);
  const int64_t* slot_p = row_slot.data_ptr<int64_t>();
  const int64_t* prefix_p = prefix.data_ptr<int64_t>();
  const int64_t* extra_p = extra.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(slot_p[r] >= 0 && slot_p[r] < S, "tree_attention: row ", r, " slot ", slot_p[r], " out of range");
    TORCH_CHECK(prefix_p[r] >= 0 && prefix_p[r] <= C, "tree_attention: row ", r, " prefix ", prefix_p[r], " > capacity");
    int64_t keys = prefix_p[r];
    for (int64_t e = 0; e < E; ++e) {
      const int64_t pos = extra_p[r * E + e];
      TORCH_CHECK(pos < C, "tree_attention: row ", r, " position ", pos, " > capacity");
      keys += pos >= 0;
    }
    TORCH_CHECK(keys > 0, "tree_attention: row ", r, " attends to no key");
  }
  // each row's own K/V [R, Hkv, D] first, at (row_slot[r], write_pos[r]): decode's token, a prompt
  // token, a draft node; rows write distinct positions, and every write lands before any row reads
  if (k_new_in.has_value()) {
    TORCH_CHECK(v_new_in.has_value() && write_pos_in.has_value(), "tree_attention: k_new needs v_new and write_pos");
    const at::Tensor k_new = k_new_in->contiguous(), v_new = v_new_in->contiguous();
    const at::Tensor write_pos = write_pos_in->to(at::kLong).contiguous();
    check(k_new, "k_new", 3, at::kFloat);
    check(v_new, "v_new", 3, at::kFloat);
    TORCH_CHECK(k_new.size(0) == R && k_new.size(1) == Hkv && k_new.size(2) == D && v_new.sizes() == k_new.sizes(),
                "tree_attention: k_new and v_new must be [", R, ", ", Hkv, ", ", D, "]");
    TORCH_CHECK(write_pos.numel() == R, "tree_attention: write_pos must have one position per row");
    const int64_t* wp = write_pos.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(wp[r] >= 0 && wp[r] < C, "tree_attention: row ", r, " writes position ", wp[r], " outside capacity ", C);
    const float* kn = k_new.data_ptr<float>();
    const float* vn = v_new.data_ptr<float>();
    const int64_t ss = k_cache.stride(0), sh = k_cache.stride(1);
    auto write = [&](auto* kw, auto* vw) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < Hkv; ++g) {
          const int64_t dst = slot_p[r] * ss + g * sh + wp[r] * D, src = (r * Hkv + g) * D;
          if constexpr (std::is_same_v<std::remove_pointer_t<decltype(kw)>, float>) {
            std::memcpy(kw + dst, kn + src, D * sizeof(float));
            std::memcpy(vw + dst, vn + src, D * sizeof(float));
          } else {
            for (int64_t d = 0; d < D; ++d) kw[dst + d] = arborl::bf16_round(kn[src + d]);
            for (int64_t d = 0; d < D; ++d) vw[dst + d] = arborl::bf16_round(vn[src + d]);
          }
        }
    };
    if (bf16)
      write(static_cast<bf16_t*>(k_cache.data_ptr()), static_cast<bf16_t*>(v_cache.data_ptr()));
    else
      write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  at::Tensor out = at::empty({R, Hq, D}, q.options());
  const float* qd = q.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t s_slot = k_cache.stride(0), s_head = k_cache.stride(1);
  const float fscale = static_cast<float>(scale);
  const int level = arborl::isa();

  auto attend = [&](const auto* kd, const auto* vd) {
    at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<int64_t> keys;
      std::vector<float> acc(G * D), wide(8 * D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / Hkv, g = task % Hkv;
        keys.clear();
        for (int64_t j = 0; j < prefix_p[r]; ++j) keys.push_back(j);
        for (int64_t e = 0; e < E; ++e)
          if (extra_p[r * E + e] >= 0) keys.push_back(extra_p[r * E + e]);
        const int64_t L = static_cast<int64_t>(keys.size());
        scores.resize(G * L);
        const auto* kbase = kd + slot_p[r] * s_slot + g * s_head;
        const auto* vbase = vd + slot_p[r] * s_slot + g * s_head;
        const float* qrow = qd + (r * Hq + g * G) * D;
#ifdef ARBORL_X86
        if (level >= arborl::kAvx512)
          scores_heads_avx512(qrow, G, kbase, keys.data(), L, D, fscale, scores.data(), wide.data(), vbase);
        else
#endif
          for (int64_t h = 0; h < G; ++h) scores_row(qrow + h * D, kbase, keys.data(), L, D, fscale, scores.data() + h * L, level);
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::vector<float> total(G, 0.0f);
        for (int64_t h = 0; h < G; ++h) {
          float* s = scores.data() + h * L;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < L; ++j) m = s[j] > m ? s[j] : m;
          for (int64_t j = 0; j < L; ++j) s[j] = arborl::exp_poly(s[j] - m);
          float part[8] = {0};
          int64_t j = 0;
          for (; j + 8 <= L; j += 8)
            for (int u = 0; u < 8; ++u) part[u] += s[j + u];
          float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
          for (; j < L; ++j) sum += s[j];
          total[h] = sum;
        }
        bool joint = false;
#ifdef ARBORL_X86
        if (level >= arborl::kAvx512) {
          // the next task's cache rows [0, its prefix) start coming in while this one sums V
          const int64_t r1 = (task + 1) / Hkv, g1 = (task + 1) % Hkv;
          const bool more = task + 1 < end;
          joint = weighted_sum_heads(scores.data(), G, L, vbase, keys.data(), D, acc.data(),
                                     more ? kd + slot_p[r1] * s_slot + g1 * s_head : kbase, more ? prefix_p[r1] : 0);
        }
#endif
        if (!joint)
          for (int64_t h = 0; h < G; ++h) weighted_sum(scores.data() + h * L, vbase, keys.data(), L, D, acc.data() + h * D, level);
        for (int64_t h = 0; h < G; ++h) {
          float* o = od + (r * Hq + g * G + h) * D;
          const float inv = 1.0f / total[h];
          for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
        }
      }
    });
  };
  if (bf16)
    attend(static_cast<const bf16_t*>(k_cache.data_ptr()), static_cast<const bf16_t*>(v_cache.data_ptr()));
  else
    attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return out;
}


}  // namespace

TORCH_LIBRARY(arborl, m) {
  m.def("tree_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor row_slot, Tensor prefix, Tensor extra, "
        "float scale, Tensor? k_new=None, Tensor? v_new=None, Tensor? write_pos=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborl, CPU, m) {
  m.impl("tree_attention", &tree_attention);
}
