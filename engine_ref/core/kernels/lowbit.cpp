// Low-bit and float32 GEMMs for small batches (M rows of float32 activations) on AVX2 + FMA CPUs.
//
// A decode step multiplies a handful of activation rows by every weight matrix once, so it is
// bound by the bytes of weights it streams. These kernels read each 4-bit or 8-bit weight
// once, widen it to float32 in registers and accumulate in float32; no dequantised matrix
// exists in memory. Rows of the output are split across torch's intra-op thread pool.
//
// refkern::q4_gemm(x [M, K] f32, packed [N, K/2] u8, scale [N, K/32] f16, minimum [N, K/32] f16)
//   -> y [M, N] f32, with w[n, 32 g + i] = q * scale[n, g] + minimum[n, g]. K is a multiple of
//   64; each 64 weights of a row are 8 little-endian uint32 lanes, lane j holding q[8 t + j] in
//   bits 4 t .. 4 t + 3 (t = 0..7), so one 32-byte load and a mask per t widen 8 weights at
//   once without shuffles (`pack_q4` in kernels/__init__.py writes it).
// refkern::q8_gemm(x [M, K] f32, weight [N, K] i8, scale [N] f32) -> y [M, N] f32,
//   w[n, k] = weight[n, k] * scale[n].
// refkern::f32_gemm(x [M, K] f32, weight [N, K] f32) -> y [M, N] f32. Each weight row is read
//   once for up to 8 activation rows, so a few rows cost about what one does (torch's GEMM
//   for M = 5 took 1.7x its M = 1 time at SmolLM2's shapes). Each output is one fixed
//   sequence of FMAs whatever M is, so a row's result does not depend on its batch.
#include <ATen/record_function.h>
#include <torch/library.h>

#include "simd.h"

namespace refkern {
namespace {

inline __m256 widen_i8(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Rows [n0, n1) of y for activation rows [m0, m0 + R). R is a template argument so the
// accumulators live in registers. `xw` is x with each position scaled by 16^-t (see
// `q4_matmul`): a nibble is widened by masking it in place, so its integer is q * 16^t.
template <int R>
void q4_rows(const float* xw, const float* xsum, const uint8_t* packed, const uint16_t* scale,
             const uint16_t* minimum, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
             int64_t n1) {
  const int64_t groups = K / kGroup, pairs = K / 64;
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = packed + n * (K / 2);
    const uint16_t* srow = scale + n * groups;
    const uint16_t* mrow = minimum + n * groups;
    __m256 acc[R], acc2[R];
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + p * 32));
      __m256i v4 = _mm256_srli_epi32(v, 4);
      __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
      __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_slli_epi32(mask, 4)));
      __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_slli_epi32(mask, 8)));
      __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_slli_epi32(mask, 12)));
      __m256 s0 = _mm256_set1_ps(_cvtsh_ss(srow[2 * p]));
      for (int r = 0; r < R; ++r) {  // two short chains per group, summed
        const float* xg = xw + (m0 + r) * K + p * 64;
        __m256 ta = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xg)));
        __m256 tb = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(xg + 16)));
        acc[r] = _mm256_fmadd_ps(_mm256_add_ps(ta, tb), s0, acc[r]);
      }
      w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_slli_epi32(mask, 16)));
      w1 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_slli_epi32(mask, 20)));
      w2 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_slli_epi32(mask, 24)));
      w3 = _mm256_cvtepi32_ps(_mm256_and_si256(v4, _mm256_slli_epi32(mask, 24)));
      __m256 s1 = _mm256_set1_ps(_cvtsh_ss(srow[2 * p + 1]));
      for (int r = 0; r < R; ++r) {  // a second accumulator: no chain across the two groups
        const float* xg = xw + (m0 + r) * K + p * 64 + 32;
        __m256 ta = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xg)));
        __m256 tb = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(xg + 16)));
        acc2[r] = _mm256_fmadd_ps(_mm256_add_ps(ta, tb), s1, acc2[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float offset = dot_half(mrow, xsum + (m0 + r) * groups, groups);
      y[(m0 + r) * N + n] = hsum(_mm256_add_ps(acc[r], acc2[r])) + offset;
    }
  }
}

template <int R>
void q8_rows(const float* x, const int8_t* weight, const float* scale, float* y, int64_t K,
             int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wrow = weight + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m256 w0 = widen_i8(wrow + k), w1 = widen_i8(wrow + k + 8);
      for (int r = 0; r < R; ++r) {
        const float* xk = x + (m0 + r) * K + k;
        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk), acc[r]);
        acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + 8), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) * scale[n];
  }
}

// Weight rows n .. n + B - 1 against activation rows [m0, m0 + R). Per 16 columns a pass
// loads 2 B weight and 2 R activation vectors for 2 B R FMAs: B = 2 halves the x loads.
template <int R, int B>
inline void f32_block(const float* x, const float* weight, float* y, int64_t K, int64_t N,
                      int64_t m0, int64_t n) {
  __m256 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 w0[B], w1[B];
    for (int b = 0; b < B; ++b) {
      w0[b] = _mm256_loadu_ps(weight + (n + b) * K + k);
      w1[b] = _mm256_loadu_ps(weight + (n + b) * K + k + 8);
    }
    for (int r = 0; r < R; ++r) {
      const float* xk = x + (m0 + r) * K + k;
      const __m256 x0 = _mm256_loadu_ps(xk), x1 = _mm256_loadu_ps(xk + 8);
      for (int b = 0; b < B; ++b) {
        acc[b][r] = _mm256_fmadd_ps(w0[b], x0, acc[b][r]);
        acc[b][r] = _mm256_fmadd_ps(w1[b], x1, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n + b] = hsum(acc[b][r]);
}

// Every output is the same sequence of FMAs (per 16 columns, two into one accumulator, then
// one horizontal sum) whichever block it falls in, so a row's result never depends on M.
template <int R>
void f32_rows(const float* x, const float* weight, float* y, int64_t K, int64_t N, int64_t m0,
              int64_t n0, int64_t n1) {
  constexpr int B = R <= 4 ? 2 : 1;  // 2 B R accumulators + 2 B weights fit 16 registers
  int64_t n = n0;
  for (; n + B <= n1; n += B) f32_block<R, B>(x, weight, y, K, N, m0, n);
  for (; n < n1; ++n) f32_block<R, 1>(x, weight, y, K, N, m0, n);
}

}  // namespace

void check_x(const at::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % multiple == 0, "K must be a multiple of ", multiple, ", got ", K);
}

void check_q4(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(K % 64 == 0, "K must be a multiple of 64, got ", K);
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && scale.size(1) == K / kGroup,
              "scale must be float16 [N, K/32]");
  TORCH_CHECK(minimum.sizes() == scale.sizes() && minimum.is_contiguous() &&
                  minimum.scalar_type() == at::kHalf,
              "minimum must be float16 [N, K/32]");
}

// y [M, N] = x [M, K] @ W.T for int4 W (see the header). `work` holds M * (K + K / 32) floats.
void q4_matmul(const float* x, int64_t M, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum, float* y, float* work) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, groups = K / kGroup;
  // Per row: the sum of x over each group (for the minima), and x with position 8 t + j of
  // each 64 scaled by 16^-t (t = 7 is shifted down by 4 first, so 16^-6), since a nibble
  // widened in place is q * 16^t. Powers of two: exact.
  float* xw = work;
  float* xs = work + M * K;
  float step[64];
  for (int i = 0; i < 64; ++i) step[i] = std::ldexp(1.0f, -4 * std::min(i / 8, 6));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) xs[m * groups + g] = sum(x + m * K + g * kGroup, kGroup);
    for (int64_t k = 0; k < K; ++k) xw[m * K + k] = x[m * K + k] * step[k % 64];
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  for_row_blocks(M, N, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    q4_rows<decltype(r)::value>(xw, xs, wp, sp, mp, y, K, N, m0, n0, n1);
  });
}

void check_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be contiguous float32 [N, K]");
  TORCH_CHECK(weight.size(1) % 16 == 0, "K must be a multiple of 16, got ", weight.size(1));
}

void f32_matmul(const float* x, int64_t M, const at::Tensor& weight, float* y) {
  const int64_t N = weight.size(0), K = weight.size(1);
  const float* wp = weight.data_ptr<float>();
  for_row_blocks(M, N, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    f32_rows<decltype(r)::value>(x, wp, y, K, N, m0, n0, n1);
  });
}

namespace {

at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                   const at::Tensor& minimum) {
  check_q4(packed, scale, minimum);
  const int64_t N = packed.size(0), K = packed.size(1) * 2, M = x.size(0);
  check_x(x, K, 64);
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<float> work(M * (K + K / kGroup));
  q4_matmul(x.data_ptr<float>(), M, packed, scale, minimum, y.data_ptr<float>(), work.data());
  return y;
}

at::Tensor q8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, 16);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "weight: int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "scale must be float32 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_row_blocks(M, N, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    q8_rows<decltype(r)::value>(xp, wp, sp, yp, K, N, m0, n0, n1);
  });
  return y;
}

at::Tensor f32_gemm(const at::Tensor& x, const at::Tensor& weight) {
  check_f32(weight);
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, 16);
  at::Tensor y = at::empty({M, N}, x.options());
  f32_matmul(x.data_ptr<float>(), M, weight, y.data_ptr<float>());
  return y;
}

}  // namespace
}  // namespace refkern

// The ops of the other sources join this library with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(refkern, m) {
  m.def("q4_gemm(Tensor x, Tensor packed, Tensor scale, Tensor minimum) -> Tensor");
  m.def("q8_gemm(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("f32_gemm(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(refkern, CPU, m) {
  m.impl("q4_gemm", refkern::q4_gemm);
  m.impl("q8_gemm", refkern::q8_gemm);
  m.impl("f32_gemm", refkern::f32_gemm);
}
