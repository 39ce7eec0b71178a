// The KV pool's storage formats (engine_ref/core/kv_dtype.py), read and written the same way
// by the paged decode kernel (paged_attention.cpp) and the fused decoder layer (layer.cpp):
// float32, bfloat16 (as uint16_t bits), float16, and int8 or fp8 e4m3 values with a float32
// scale per row of head_dim values. One copy of these rules, so both kernels store the same
// bytes (those `kv_dtype.store_rows` stores) and read them back as the same numbers.
//
// Reading widens in registers: bfloat16 by a 16-bit shift, float16 through F16C, int8 by a
// sign extension, fp8 e4m3 by moving its bits into float16 positions (F16C then widens it
// exactly, subnormals included) and multiplying by 2^8. A scaled row's scale is not applied
// here: the kernels multiply a key's dot product and a value's softmax weight by it, so no row
// is dequantised in memory.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

namespace refkern {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // bfloat16
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, uint16_t* dst) {  // round to nearest even, as torch does
  *dst = c10::BFloat16(x).x;
}
inline void from_float(float x, c10::Half* dst) { *dst = c10::Half(x); }

// The storage formats with a float32 scale per row, and the magnitude a row's absmax maps to.
template <typename S>
constexpr bool kScaled = std::is_same<S, int8_t>::value ||
                         std::is_same<S, c10::Float8_e4m3fn>::value;
template <typename S>
constexpr float kQMax = std::is_same<S, int8_t>::value ? 127.0f : 448.0f;

inline void encode(float x, int8_t* dst) {  // half to even (the default rounding mode)
  *dst = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x))));
}
inline void encode(float x, c10::Float8_e4m3fn* dst) {  // torch's own conversion
  *dst = c10::Float8_e4m3fn(std::min(448.0f, std::max(-448.0f, x)));
}

// Store one row of hd values (Q: float, or uint16_t for bfloat16) in the pool's format S, as
// kv_dtype.py's `store_rows` does: converted, or quantised with its scale written to *scale
// (scale = absmax / qmax, 0 for a zero row; value = x / scale rounded). `scale` is unused for
// the unscaled formats.
template <typename Q, typename S>
void store_row(const Q* src, int64_t hd, S* dst, float* scale) {
  if constexpr (std::is_same<Q, S>::value) {
    std::memcpy(dst, src, hd * sizeof(S));
  } else if constexpr (kScaled<S>) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < hd; ++i) absmax = std::max(absmax, std::fabs(to_float(src[i])));
    const float s = absmax / kQMax<S>;
    const float divisor = s > 0.0f ? s : 1.0f;
    for (int64_t i = 0; i < hd; ++i) encode(to_float(src[i]) / divisor, dst + i);
    *scale = s;
  } else {
    for (int64_t i = 0; i < hd; ++i) from_float(to_float(src[i]), dst + i);
  }
}

// 8 stored values widened to float32 (AVX2 + F16C, the lowest level every library has).
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {  // bfloat16: the bits move up 16 places
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
// fp8 e4m3 (s eeee mmm) as the float16 s 0eeee mmm0000000 is the same number times 2^-8,
// normals and subnormals alike (both formats' subnormals have the exponent of their bias).
inline __m256 widen8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
}

#if defined(__AVX512F__)
// 16 stored values widened to float32, as widen8.
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 widen16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
inline __m512 widen16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
}
#endif

}  // namespace refkern
