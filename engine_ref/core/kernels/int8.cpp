// GEMMs with int8 activations: W4A8 (int4 weights in groups of 32, a scale and a minimum each)
// and W8A8 (int8 weights, a scale per output row). Each call quantises its float32
// activations to int8, one symmetric scale per row (a = amax / 127, q = round-half-even(x / a)
// within +-127; an all-zero row gets a = 1), multiplies in integers and scales once at the end.
//
// refkern::q4_i8_gemm(x [M, K] f32, packed [ceil(N/16), K/32 * 320] u8, int n) -> y [M, N] f32
//   y[m, n] = a_m * sum_g (scale[n, g] * sum_{k in g} q[n, k] xq[m, k] + minimum[n, g] * xs[m, g])
//   where xs[m, g] = sum_{k in g} xq[m, k]: the minimum multiplies the same int8 activations as
//   the nibbles, so y is exactly (a_m xq) @ W.T up to float32 rounding. (The float sum of x
//   would leave the minimum's product unquantised, but add sum_k e_k (w_k - minimum) of
//   rounding error e in place of sum_k e_k w_k: larger, since the minimum is about -7.5 scales.)
// refkern::q8_i8_gemm(x [M, K] f32, packed [ceil(N/16), ceil(K/4) * 64 + 128] i8, int n)
//   y[m, n] = a_m * scale[n] * sum_k w[n, k] xq[m, k].
//
// Layouts (`pack_q4_i8`, `pack_q8_i8` in kernels/int8.py): output rows in blocks of 16, one
// int32 lane each, so no horizontal sum is ever taken. In a lane, 4 consecutive inputs of the
// lane's row sit in 4 bytes; `vpdpbusd` multiplies them by the same 4 int8 activations
// broadcast to every lane and adds the 4 products to the lane. q4_i8: per (block, group of 32)
// a 320-byte chunk: 4 runs of 64 bytes (16 rows x 4 bytes), byte b of row l in run t holding
// q[l, 8 t + b] in its low nibble and q[l, 8 t + 4 + b] in its high one (one mask, or a shift
// and a mask, widens 16 rows x 4 inputs at once), then 16 float16 scales and 16 float16
// minima. q8_i8: per block ceil(K/4) runs of 64 bytes (16 rows x 4 int8, zero past K), then
// 16 float32 scales and 16 int32 row sums of the weights.
//
// Instruction sets: `vpdpbusd` (u8 x s8, 4 products per int32 lane) under __AVX512VNNI__;
// without VNNI, `vpmaddubsw` (pairs of u8 x s8 into int16) and `vpmaddwd` (pairs of int16 into
// int32), 512 bits wide under __AVX512BW__ and 256 bits on AVX2. int4 weights are u8 and the
// activations s8: a pair is at most 2 * 15 * 127, and 8 pairs (one group) 30480, inside int16.
// int8 weights are s8: VNNI takes the activations as u8 (xq + 128) and subtracts 128 * the row
// sum; the others multiply |w| by xq with w's sign (at most 2 * 127 * 127 a pair). Every path
// computes the same integer per (row, group), then the same per-lane float32 operations in the
// same order, so y is bit for bit the same at every level, and a row's result does not depend
// on the other rows of the call.
#include "int8.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace refkern {
namespace {

#if defined(__AVX512F__)
constexpr int kMaxRows = 8;  // activation rows per pass over a block (accumulators in registers)
#else
constexpr int kMaxRows = 4;
#endif
#if defined(__AVX512VNNI__)
constexpr bool kUnsignedActivations = true;  // q8_i8 under VNNI: xq + 128 as u8
#else
constexpr bool kUnsignedActivations = false;
#endif
constexpr int64_t kMaxQ8K = 65536;  // (xq + 128) * w sums stay inside int32

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__)
// acc + the four u8 x s8 products in each int32 lane. GCC 12 gives `_mm512_dpbusd_epi32`'s
// accumulator only zmm0-15 and, with more live, copies it there and back around every one
// (three instructions for one, measured 2x slower at 256 rows); the asm may use all 32.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, u8, s8);
#endif
}
#endif

// Activation rows quantised to int8.
struct Int8Rows {
  int64_t stride = 0;         // Kp: K rounded up to 4, zeros past K
  std::vector<int8_t> q;      // [M, stride]
  std::vector<float> scale;   // [M]
  std::vector<int32_t> sums;  // [M, K / 32] group sums of q, when asked for
};

// q[k] = round-half-even(clamp(x[k] / a, -127, 127)); returns a. The vector lanes and the
// scalar tail compute the same IEEE operations.
float quantize_row(const float* x, int64_t K, int8_t* q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float a = amax > 0.0f ? amax / 127.0f : 1.0f;
  const __m256 va = _mm256_set1_ps(a), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (k = 0; k + 8 <= K; k += 8) {
    __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), va), lo), hi);
    r = _mm256_round_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i32 = _mm256_cvtps_epi32(r);
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(i16, i16));
  }
  for (; k < K; ++k) q[k] = static_cast<int8_t>(std::nearbyint(std::min(std::max(x[k] / a, -127.0f), 127.0f)));
  return a;
}

Int8Rows quantize_rows(const float* x, int64_t M, int64_t K, bool group_sums, bool offset) {
  Int8Rows rows;
  rows.stride = (K + 3) / 4 * 4;
  rows.q.assign(M * rows.stride, 0);
  rows.scale.resize(M);
  const int64_t groups = K / kI8Group;
  if (group_sums) rows.sums.resize(M * groups);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = rows.q.data() + m * rows.stride;
      rows.scale[m] = quantize_row(x + m * K, K, q);
      for (int64_t g = 0; group_sums && g < groups; ++g) {
        int32_t s = 0;
        for (int64_t i = 0; i < kI8Group; ++i) s += q[g * kI8Group + i];
        rows.sums[m * groups + g] = s;
      }
      if (offset)  // xq + 128 as u8 (the padding too: it meets zero weights)
        for (int64_t k = 0; k < rows.stride; ++k) q[k] = static_cast<int8_t>(q[k] ^ 0x80);
    }
  });
  return rows;
}

#if defined(__AVX512F__)

// One 16-row block of y for activation rows [m0, m0 + R).
template <int R>
void q4_block(const uint8_t* blk, int64_t groups, const Int8Rows& xr, int64_t m0, float* y,
              int64_t N, int64_t n0) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  const int8_t* xq = xr.q.data() + m0 * xr.stride;
  const int32_t* xs = xr.sums.data() + m0 * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = blk + g * kQ4I8ChunkBytes;
    __m512i isum[R];
#if defined(__AVX512VNNI__)
    constexpr int C = R <= 2 ? 2 : 1;  // two chains when few rows give little parallelism
    __m512i acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(chunk + 64 * t);
      const __m512i w0 = _mm512_and_si512(v, low);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xk = xq + r * xr.stride + g * kI8Group + 8 * t;
        acc[0][r] = dpbusd(acc[0][r], w0, _mm512_set1_epi32(load4(xk)));
        acc[C - 1][r] = dpbusd(acc[C - 1][r], w1, _mm512_set1_epi32(load4(xk + 4)));
      }
    }
    for (int r = 0; r < R; ++r) isum[r] = C == 2 ? _mm512_add_epi32(acc[0][r], acc[C - 1][r]) : acc[0][r];
#else
    const __m512i ones = _mm512_set1_epi16(1);
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(chunk + 64 * t);
      const __m512i w0 = _mm512_and_si512(v, low);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xk = xq + r * xr.stride + g * kI8Group + 8 * t;
        acc[r] = _mm512_add_epi16(acc[r], _mm512_maddubs_epi16(w0, _mm512_set1_epi32(load4(xk))));
        acc[r] = _mm512_add_epi16(acc[r], _mm512_maddubs_epi16(w1, _mm512_set1_epi32(load4(xk + 4))));
      }
    }
    for (int r = 0; r < R; ++r) isum[r] = _mm512_madd_epi16(acc[r], ones);
#endif
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 288)));
    for (int r = 0; r < R; ++r) {
      facc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum[r]), facc[r]);
      facc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(static_cast<float>(xs[r * groups + g])), facc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, _mm512_mul_ps(facc[r], _mm512_set1_ps(xr.scale[m0 + r])));
}

// Blocks [b, b + B) of y (B = 1 or 2: two blocks share each activation broadcast) for
// activation rows [m0, m0 + R).
template <int R, int B>
void q8_blocks(const int8_t* blk, int64_t block_bytes, int64_t runs, const Int8Rows& xr,
               int64_t m0, float* y, int64_t N, int64_t n0) {
  const int8_t* xq = xr.q.data() + m0 * xr.stride;
  __m512i isum[B][R];
#if defined(__AVX512VNNI__)
  constexpr int C = R * B >= 4 ? 1 : 4 / (R * B);  // independent chains per accumulator
  __m512i acc[C][B][R];
  for (int c = 0; c < C; ++c)
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < R; ++r) acc[c][b][r] = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + C <= runs; j += C) {
    for (int c = 0; c < C; ++c) {
      __m512i w[B];
      for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_si512(blk + b * block_bytes + 64 * (j + c));
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(load4(xq + r * xr.stride + 4 * (j + c)));
        for (int b = 0; b < B; ++b) acc[c][b][r] = dpbusd(acc[c][b][r], xb, w[b]);
      }
    }
  }
  for (; j < runs; ++j) {
    __m512i w[B];
    for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_si512(blk + b * block_bytes + 64 * j);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(load4(xq + r * xr.stride + 4 * j));
      for (int b = 0; b < B; ++b) acc[0][b][r] = dpbusd(acc[0][b][r], xb, w[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(blk + b * block_bytes + runs * 64 + 64), 7);
    for (int r = 0; r < R; ++r) {
      __m512i s = acc[0][b][r];
      for (int c = 1; c < C; ++c) s = _mm512_add_epi32(s, acc[c][b][r]);
      isum[b][r] = _mm512_sub_epi32(s, offset);  // minus 128 * the row sum
    }
  }
#else
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) isum[b][r] = _mm512_setzero_si512();
  for (int64_t j = 0; j < runs; ++j) {
    for (int b = 0; b < B; ++b) {
      const __m512i w = _mm512_loadu_si512(blk + b * block_bytes + 64 * j);
      const __m512i magnitude = _mm512_abs_epi8(w);
      const __mmask64 negative = _mm512_movepi8_mask(w);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(load4(xq + r * xr.stride + 4 * j));
        const __m512i signed_x = _mm512_mask_sub_epi8(xb, negative, zero, xb);
        isum[b][r] = _mm512_add_epi32(isum[b][r], _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_x), ones));
      }
    }
  }
#endif
  for (int b = 0; b < B; ++b) {
    const int64_t nb = n0 + b * kI8BlockRows;
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + b * block_bytes + runs * 64));
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - nb)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[b][r]), scale);
      _mm512_mask_storeu_ps(y + (m0 + r) * N + nb, mask, _mm512_mul_ps(v, _mm512_set1_ps(xr.scale[m0 + r])));
    }
  }
}

#else  // AVX2: each 16-row block as two halves of 8 rows, the same operations per lane

template <int R>
void q4_half(const uint8_t* blk, int64_t groups, const Int8Rows& xr, int64_t m0, float* y,
             int64_t N, int64_t n0, int h) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm256_setzero_ps();
  const int8_t* xq = xr.q.data() + m0 * xr.stride;
  const int32_t* xs = xr.sums.data() + m0 * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = blk + g * kQ4I8ChunkBytes;
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * t + 32 * h));
      const __m256i w0 = _mm256_and_si256(v, low);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xk = xq + r * xr.stride + g * kI8Group + 8 * t;
        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(load4(xk))));
        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(load4(xk + 4))));
      }
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 256 + 16 * h)));
    const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 288 + 16 * h)));
    for (int r = 0; r < R; ++r) {
      const __m256i isum = _mm256_madd_epi16(acc[r], ones);
      facc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), facc[r]);
      facc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(static_cast<float>(xs[r * groups + g])), facc[r]);
    }
  }
  const int64_t count = std::min<int64_t>(8, N - n0);
  alignas(32) float tmp[8];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tmp, _mm256_mul_ps(facc[r], _mm256_set1_ps(xr.scale[m0 + r])));
    std::memcpy(y + (m0 + r) * N + n0, tmp, sizeof(float) * count);
  }
}

template <int R>
void q4_block(const uint8_t* blk, int64_t groups, const Int8Rows& xr, int64_t m0, float* y,
              int64_t N, int64_t n0) {
  q4_half<R>(blk, groups, xr, m0, y, N, n0, 0);
  if (N - n0 > 8) q4_half<R>(blk, groups, xr, m0, y, N, n0 + 8, 1);
}

template <int R>
void q8_half(const int8_t* blk, int64_t runs, const Int8Rows& xr, int64_t m0, float* y,
             int64_t N, int64_t n0, int h) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq = xr.q.data() + m0 * xr.stride;
  __m256i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  for (int64_t j = 0; j < runs; ++j) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
    const __m256i magnitude = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r) {
      const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(load4(xq + r * xr.stride + 4 * j)), w);
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
    }
  }
  const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + runs * 64) + 8 * h);
  const int64_t count = std::min<int64_t>(8, N - n0);
  alignas(32) float tmp[8];
  for (int r = 0; r < R; ++r) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r]), scale);
    _mm256_store_ps(tmp, _mm256_mul_ps(v, _mm256_set1_ps(xr.scale[m0 + r])));
    std::memcpy(y + (m0 + r) * N + n0, tmp, sizeof(float) * count);
  }
}

template <int R, int B>
void q8_blocks(const int8_t* blk, int64_t block_bytes, int64_t runs, const Int8Rows& xr,
               int64_t m0, float* y, int64_t N, int64_t n0) {
  for (int b = 0; b < B; ++b) {
    const int64_t nb = n0 + b * kI8BlockRows;
    q8_half<R>(blk + b * block_bytes, runs, xr, m0, y, N, nb, 0);
    if (N - nb > 8) q8_half<R>(blk + b * block_bytes, runs, xr, m0, y, N, nb + 8, 1);
  }
}

#endif

template <typename F>
void dispatch_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
#if defined(__AVX512F__)
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
#endif
    default: f(std::integral_constant<int, kMaxRows>{}); break;
  }
}

// Blocks of 16 output rows split over torch's threads (one task per thread); within a task,
// each block (or pair of blocks, with `pairs`) against the activation rows in passes of up to
// kMaxRows, so a block's weights are read from memory once and from cache for the later
// passes: f(R, B, m0, first block), B = 1 or 2 blocks.
template <bool pairs, typename F>
void for_blocks(int64_t M, int64_t blocks, F&& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (blocks + threads - 1) / threads);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const bool two = pairs && b + 1 < b1;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        dispatch_rows(std::min<int64_t>(kMaxRows, M - m0), [&](auto r) {
          if (two) f(r, std::integral_constant<int, 2>{}, m0, b);
          else f(r, std::integral_constant<int, 1>{}, m0, b);
        });
      b += two ? 2 : 1;
    }
  });
}

void check_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
}

void check_n(int64_t n, int64_t blocks) {
  TORCH_CHECK(n > (blocks - 1) * kI8BlockRows && n <= blocks * kI8BlockRows, "n = ", n,
              " does not fit the ", blocks, " blocks of 16 rows in packed");
}

at::Tensor q4_i8_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_activations(x);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) % kQ4I8ChunkBytes == 0,
              "packed must be contiguous uint8 [ceil(N/16), K/32 * 320] (pack_q4_i8)");
  const int64_t K = packed.size(1) / kQ4I8ChunkBytes * kI8Group, M = x.size(0);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  check_n(n, packed.size(0));
  at::Tensor y = at::empty({M, n}, x.options());
  q4_i8_matmul(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), n, y.data_ptr<float>());
  return y;
}

at::Tensor q8_i8_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_activations(x);
  const int64_t K = x.size(1), M = x.size(0);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "packed must be contiguous int8 [ceil(N/16), ceil(K/4) * 64 + 128] (pack_q8_i8)");
  TORCH_CHECK(packed.size(1) == (K + 3) / 4 * 64 + kQ8I8TailBytes, "x has ", K,
              " columns, the packed weight ", (packed.size(1) - kQ8I8TailBytes) / 16, " (rounded up to 4)");
  check_n(n, packed.size(0));
  at::Tensor y = at::empty({M, n}, x.options());
  q8_i8_matmul(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), n, y.data_ptr<float>());
  return y;
}

}  // namespace

void q4_i8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                  float* y) {
  TORCH_CHECK(K % kI8Group == 0, "K must be a multiple of ", kI8Group, ", got ", K);
  if (M == 0 || N == 0) return;
  const Int8Rows xr = quantize_rows(x, M, K, /*group_sums=*/true, /*offset=*/false);
  const int64_t groups = K / kI8Group, block_bytes = groups * kQ4I8ChunkBytes;
  for_blocks<false>(M, (N + kI8BlockRows - 1) / kI8BlockRows, [&](auto r, auto, int64_t m0, int64_t b) {
    q4_block<decltype(r)::value>(packed + b * block_bytes, groups, xr, m0, y, N, b * kI8BlockRows);
  });
}

void q8_i8_matmul(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N,
                  float* y) {
  TORCH_CHECK(K <= kMaxQ8K, "q8_i8_gemm takes at most ", kMaxQ8K, " columns, got ", K);
  if (M == 0 || N == 0) return;
  const Int8Rows xr = quantize_rows(x, M, K, /*group_sums=*/false, kUnsignedActivations);
  const int64_t runs = xr.stride / 4, block_bytes = runs * 64 + kQ8I8TailBytes;
  // Pairs: each activation broadcast feeds two blocks (10% faster from 4 to 64 rows).
  for_blocks<true>(M, (N + kI8BlockRows - 1) / kI8BlockRows, [&](auto r, auto two, int64_t m0, int64_t b) {
    q8_blocks<decltype(r)::value, decltype(two)::value>(packed + b * block_bytes, block_bytes, runs, xr, m0, y, N, b * kI8BlockRows);
  });
}

}  // namespace refkern

TORCH_LIBRARY_FRAGMENT(refkern, m) {
  m.def("q4_i8_gemm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("q8_i8_gemm(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(refkern, CPU, m) {
  m.impl("q4_i8_gemm", refkern::q4_i8_gemm);
  m.impl("q8_i8_gemm", refkern::q8_i8_gemm);
}
