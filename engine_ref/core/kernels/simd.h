// What the engine kernels' sources share: vector helpers (AVX2 + FMA + F16C, the lowest
// level every library is built for), the split of a GEMM's output rows over torch's threads,
// and the matmuls `decode_layer` calls. Everything here is inline or declared, so each source
// includes it and the library holds one copy.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace refkern {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowsPerPass = 8;  // activation rows sharing one unpack of a weight group

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of a[i] * b[i]: 8 lanes at a time (a scalar chain would wait on each add's latency).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = hsum(acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// Sum of half(a[i]) * b[i].
inline float dot_half(const uint16_t* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    acc = _mm256_fmadd_ps(wide, _mm256_loadu_ps(b + i), acc);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += _cvtsh_ss(a[i]) * b[i];
  return total;
}

inline float sum(const float* a, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(_mm256_loadu_ps(a + i), acc);
  float total = hsum(acc);
  for (; i < n; ++i) total += a[i];
  return total;
}

// e^x for 8 lanes, within about 2 ulp of expf for x in [-87, 88]; 0 below (-inf and NaN
// too), e^88 above. e^x = 2^n e^r with n = round(x log2 e) and |r| <= ln 2 / 2, e^r from
// Cephes' expf polynomial. The layer's SiLU and softmax run it: std::exp does not vectorise
// without -ffast-math.
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);  // else 0
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
  poly = _mm256_add_ps(_mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(poly, _mm256_castsi256_ps(two_n)), live);
}

// exp8 on one value: the loops' tails, so a position's value does not depend on where it falls.
inline float exp1(float x) {
  float lane[8] = {x};
  _mm256_storeu_ps(lane, exp8(_mm256_loadu_ps(lane)));
  return lane[0];
}

// a[i] = e^(a[i] - shift) for i < n; returns their sum.
inline float exp_shifted(float* a, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(a + i), s));
    _mm256_storeu_ps(a + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += (a[i] = exp1(a[i] - shift));
  return total;
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i].
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                            _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
}

template <typename F>
inline void dispatch_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Output rows [0, N) split over torch's threads (at least 16 a task, at most one task per
// thread); within a task, activation rows in passes of up to kRowsPerPass:
// f(integral_constant<int, R>, m0, n0, n1).
template <typename F>
inline void for_row_blocks(int64_t M, int64_t N, F&& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (N + threads - 1) / threads);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      dispatch_rows(std::min(kRowsPerPass, M - m0), [&](auto r) { f(r, m0, n0, n1); });
    }
  });
}

// bfloat16 is the top half of a float32: widening is a 16-bit shift, narrowing rounds the low
// half to nearest even (as torch's `.to(torch.bfloat16)` does); a NaN stays a quiet NaN.
inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void check_x(const at::Tensor& x, int64_t K, int64_t multiple);
void check_q4(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum);
void check_f32(const at::Tensor& weight);
void check_bf16(const at::Tensor& weight);

// y [M, N] = x [M, K] @ W.T, x and y float32 row-major, W as the ops take it (lowbit.cpp,
// bf16.cpp). `work` holds M * (K + K / 32) floats.
void q4_matmul(const float* x, int64_t M, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum, float* y, float* work);
void f32_matmul(const float* x, int64_t M, const at::Tensor& weight, float* y);
void bf16_matmul(const float* x, int64_t M, const at::Tensor& weight, float* y);

}  // namespace refkern
