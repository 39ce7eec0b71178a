// refkern::bf16_gemm(x [M, K] f32, weight [N, K] bf16) -> y [M, N] f32 for small M: what a
// bfloat16 engine's decode step runs for its projections and its output projection.
//
// A decode step streams every weight once for a few rows, so at one row it is bound by the
// bytes it reads: 2 a weight here, against 4 for f32_gemm. Accumulation is float32. Output
// rows are split over torch's threads as in f32_gemm; within a thread, tiles of weight rows
// of about 32 KB, each run for every pass of up to kRowsPerPass activation rows while it is in
// cache. Each output is one fixed sequence of operations whatever M is, so a row's result does
// not depend on its batch.
//
// Two ways to multiply, by instruction set:
// - AVX-512 BF16: `vdpbf16ps` on activations rounded to bfloat16 (x is rounded once per call;
//   products are exact, sums float32). One instruction per 32 weights and row.
// - otherwise: each weight widened to float32 in registers, float32 activations. A bfloat16 is
//   the top half of a float32, so a 32-bit lane's two weights widen without shuffles (the lane
//   shifted left by 16 is the even one, the lane with its low half cleared the odd one) and
//   the activations are reordered once per call to match; two FMAs per lane and row.
// At one row both run at the memory's speed. At 16 rows the multiply is the bound, and the
// dot-product instruction took about 0.6x the widening path's time on this project's AMD EPYC
// (576 x 576 weights, one thread, cache-resident); its activations carry bfloat16's rounding,
// as torch's bf16 matmul's do, where the widening path keeps them float32.
#include <torch/library.h>

#include "simd.h"

namespace refkern {
namespace {

// Asks for column k of weight row `row` + 2 B, the row that block after next reads: with a
// few rows multiplied per weight the hardware prefetcher alone left the stream behind (at
// 16 rows this took a third off the time of SmolLM2's weights on one thread).
inline void prefetch_ahead(const uint16_t* weight, int64_t K, int64_t row, int B, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(weight + (row + 2 * B) * K + k), _MM_HINT_T0);
}

#if defined(__AVX512BF16__)

// x [M, K] rounded to bfloat16, each row padded with zeros to whole chunks of 32.
struct DotPath {
  using X = uint16_t;
  static constexpr int64_t kChunk = 32;
  static int64_t stride(int64_t K) { return (K + kChunk - 1) / kChunk * kChunk; }

  static void prepare(const float* x, int64_t M, int64_t K, uint16_t* xb) {
    const int64_t Kp = stride(K), body = K - K % 16;
    for (int64_t m = 0; m < M; ++m) {
      const float* src = x + m * K;
      uint16_t* dst = xb + m * Kp;
      for (int64_t k = 0; k < body; k += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + k));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)h);
      }
      for (int64_t k = body; k < K; ++k) dst[k] = f32_to_bf16(src[k]);
      std::fill(dst + K, dst + Kp, 0);
    }
  }

  // Weight rows n .. n + B - 1 against activation rows [m0, m0 + R).
  template <int R, int B>
  static void block(const uint16_t* xb, const uint16_t* weight, float* y, int64_t K, int64_t N,
                    int64_t m0, int64_t n) {
    const int64_t Kp = stride(K), body = K - K % kChunk;
    __m512 acc[B][R];
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
    auto step = [&](const __m512i (&w)[B], int64_t k) {
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xb + (m0 + r) * Kp + k);
        for (int b = 0; b < B; ++b)
          acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)xv, (__m512bh)w[b]);
      }
    };
    for (int64_t k = 0; k < body; k += kChunk) {
      __m512i w[B];
      for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_si512(weight + (n + b) * K + k);
      for (int b = 0; b < B; ++b) prefetch_ahead(weight, K, n + b, B, k);
      step(w, k);
    }
    if (body < K) {  // the last K % 32 weights of each row, zeros after them
      const __mmask32 live = static_cast<__mmask32>((1u << (K - body)) - 1);
      __m512i w[B];
      for (int b = 0; b < B; ++b) w[b] = _mm512_maskz_loadu_epi16(live, weight + (n + b) * K + body);
      step(w, body);
    }
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < R; ++r) y[(m0 + r) * N + n + b] = _mm512_reduce_add_ps(acc[b][r]);
  }

  // B R accumulators, B weight vectors and one activation vector, a few registers to spare.
  template <int R>
  static constexpr int rows_at_once() {
    for (int b = 4; b > 1; --b)
      if (b * R + b + 1 <= 28) return b;
    return 1;
  }
};

using Path = DotPath;

#else

#if defined(__AVX512F__)
// 32 weights (64 bytes) a load: two 16-lane vectors.
struct Lanes {
  using V = __m512;
  using W = __m512i;
  static constexpr int64_t kChunk = 32;
  static constexpr int kRegisters = 32;
  static V zero() { return _mm512_setzero_ps(); }
  static W load_w(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static V even(W v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static V odd(W v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000u)));
  }
  static V load_x(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float total(V v) { return _mm512_reduce_add_ps(v); }
};
#else
// 16 weights (32 bytes) a load: two 8-lane vectors.
struct Lanes {
  using V = __m256;
  using W = __m256i;
  static constexpr int64_t kChunk = 16;
  static constexpr int kRegisters = 16;
  static V zero() { return _mm256_setzero_ps(); }
  static W load_w(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static V even(W v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static V odd(W v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000u)));
  }
  static V load_x(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float total(V v) { return hsum(v); }
};
#endif

// float32 x [M, K] reordered for the widening: in each whole chunk of a row its even
// positions, then its odd ones; the K % kChunk positions after the last chunk as they are.
struct WidenPath {
  using X = float;
  static constexpr int64_t kChunk = Lanes::kChunk, kHalf = kChunk / 2;
  static int64_t stride(int64_t K) { return K; }

  static void prepare(const float* x, int64_t M, int64_t K, float* xr) {
    const int64_t body = K - K % kChunk;
    for (int64_t m = 0; m < M; ++m) {
      const float* src = x + m * K;
      float* dst = xr + m * K;
      for (int64_t c = 0; c < body; c += kChunk) {
        for (int64_t i = 0; i < kHalf; ++i) {
          dst[c + i] = src[c + 2 * i];
          dst[c + kHalf + i] = src[c + 2 * i + 1];
        }
      }
      std::copy(src + body, src + K, dst + body);
    }
  }

  template <int R, int B>
  static void block(const float* xr, const uint16_t* weight, float* y, int64_t K, int64_t N,
                    int64_t m0, int64_t n) {
    using V = Lanes::V;
    const int64_t body = K - K % kChunk;
    V acc[B][R];
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = Lanes::zero();
    for (int64_t k = 0; k < body; k += kChunk) {
      V even[B], odd[B];
      for (int b = 0; b < B; ++b) {
        const Lanes::W v = Lanes::load_w(weight + (n + b) * K + k);
        prefetch_ahead(weight, K, n + b, B, k);
        even[b] = Lanes::even(v);
        odd[b] = Lanes::odd(v);
      }
      for (int r = 0; r < R; ++r) {
        const float* xk = xr + (m0 + r) * K + k;
        const V x0 = Lanes::load_x(xk), x1 = Lanes::load_x(xk + kHalf);
        for (int b = 0; b < B; ++b) {
          acc[b][r] = Lanes::fma(even[b], x0, acc[b][r]);
          acc[b][r] = Lanes::fma(odd[b], x1, acc[b][r]);
        }
      }
    }
    for (int b = 0; b < B; ++b) {
      const uint16_t* row = weight + (n + b) * K;
      for (int r = 0; r < R; ++r) {
        const float* xm = xr + (m0 + r) * K;
        float total = Lanes::total(acc[b][r]);
        for (int64_t k = body; k < K; ++k) total += bf16_to_f32(row[k]) * xm[k];
        y[(m0 + r) * N + n + b] = total;
      }
    }
  }

  // B R accumulators, 2 B widened weights and 2 activation vectors, a few registers to spare.
  template <int R>
  static constexpr int rows_at_once() {
    for (int b = 4; b > 1; --b)
      if (b * R + 2 * b + 2 <= Lanes::kRegisters - 2) return b;
    return 1;
  }
};

using Path = WidenPath;

#endif

// Weight rows [n0, n1) against activation rows [m0, m0 + R): several weight rows at once, so
// one activation row (a single FMA chain a weight row) still keeps several chains in flight.
template <int R>
void bf16_rows(const Path::X* xp, const uint16_t* weight, float* y, int64_t K, int64_t N,
               int64_t m0, int64_t n0, int64_t n1) {
  constexpr int B = Path::rows_at_once<R>();
  int64_t n = n0;
  for (; n + B <= n1; n += B) Path::block<R, B>(xp, weight, y, K, N, m0, n);
  for (; n < n1; ++n) Path::block<R, 1>(xp, weight, y, K, N, m0, n);
}

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& weight) {
  check_bf16(weight);
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, 1);
  at::Tensor y = at::empty({M, N}, x.options());
  bf16_matmul(x.data_ptr<float>(), M, weight, y.data_ptr<float>());
  return y;
}

}  // namespace

void check_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous(),
              "weight must be contiguous bfloat16 [N, K]");
}

void bf16_matmul(const float* x, int64_t M, const at::Tensor& weight, float* y) {
  const int64_t N = weight.size(0), K = weight.size(1);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  std::vector<Path::X> xp(M * Path::stride(K));
  Path::prepare(x, M, K, xp.data());
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (N + threads - 1) / threads);
  const int64_t tile = std::max<int64_t>(4, 32768 / (2 * std::max<int64_t>(K, 1)) / 4 * 4);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
        dispatch_rows(std::min(kRowsPerPass, M - m0), [&](auto r) {
          bf16_rows<decltype(r)::value>(xp.data(), wp, y, K, N, m0, t0, t1);
        });
      }
    }
  });
}

}  // namespace refkern

TORCH_LIBRARY_FRAGMENT(refkern, m) { m.def("bf16_gemm(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(refkern, CPU, m) { m.impl("bf16_gemm", refkern::bf16_gemm); }
