// Low-bit GEMMs for small batches (M rows of float32 activations) on AVX2 + FMA CPUs.
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
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

namespace {

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

template <typename F>
void dispatch_rows(int64_t rows, F&& f) {
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
void for_row_blocks(int64_t M, int64_t N, F&& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (N + threads - 1) / threads);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      dispatch_rows(std::min(kRowsPerPass, M - m0), [&](auto r) { f(r, m0, n0, n1); });
    }
  });
}

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

// One Llama decoder layer for M rows with int4 or float32 projections, each row attending to
// every position up to its own (decode rows, prefill chunks, chain drafts: all rows' K/V are
// in the pool before any row attends) or, in a token tree, to those before the tree and its
// ancestors, in place of the ~45 small torch ops and nine module calls it takes in Python
// (`model.py`):
// RMSNorm, qkv, RoPE (rotate_half pairing, signed sin as `rope_tables` builds it), the new
// K/V stored at `slots`, attention of each row over its `context_lens` positions through its
// block table, o_proj and the residual, RMSNorm, gate_up, silu(gate) * up, down_proj and the
// residual. Returns the new residual stream; writes the KV pool.
//
// weights: ln1 [D], qkv (packed, scale, minimum), o (3), ln2 [D], gate_up (3), down (3); a
// float32 projection is (weight [N, K], then two unused tensors) and runs f32_gemm.
// kv_pool [2 kvh, blocks, block_size, hd] float32; block_tables [M, nb] int64;
// slots, context_lens [M] int64; cos, sin [M, hd] float32. Token trees: tree_start and
// tree_bits [M] int64 (both empty without trees); row m then attends to position p <
// context_lens[m] only if p < tree_start[m] or bit p - tree_start[m] of tree_bits[m] is set.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList w, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& kv_pool,
                        const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, const at::Tensor& tree_start,
                        const at::Tensor& tree_bits, int64_t num_heads, double eps,
                        double attn_scale) {
  TORCH_CHECK(w.size() == 14, "decode_layer takes 14 weight tensors, got ", w.size());
  const int64_t M = x.size(0), D = x.size(1);
  check_x(x, D, 16);
  auto dense = [&](int i) { return w[i].scalar_type() == at::kFloat; };
  for (int i : {1, 4, 8, 11}) dense(i) ? check_f32(w[i]) : check_q4(w[i], w[i + 1], w[i + 2]);
  auto in_features = [&](int i) { return dense(i) ? w[i].size(1) : w[i].size(1) * 2; };
  const int64_t kv2 = kv_pool.size(0), kvh = kv2 / 2, bs = kv_pool.size(2), hd = kv_pool.size(3);
  const int64_t qkv_n = w[1].size(0), gu_n = w[8].size(0), inter = gu_n / 2;
  TORCH_CHECK(qkv_n == (num_heads + kv2) * hd, "qkv rows do not match the heads");
  TORCH_CHECK(in_features(1) == D && in_features(8) == D, "qkv and gate_up take D columns");
  TORCH_CHECK(in_features(4) == num_heads * hd && w[4].size(0) == D, "o_proj shape");
  TORCH_CHECK(in_features(11) == inter && w[11].size(0) == D, "down_proj shape");
  TORCH_CHECK(kv_pool.scalar_type() == at::kFloat && kv_pool.is_contiguous(), "kv_pool: f32");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(0) == M &&
                  cos.size(1) == hd && sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos, sin must be float32 [M, hd]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == M &&
                  context_lens.scalar_type() == at::kLong && context_lens.numel() == M &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == M,
              "slots, context_lens [M] and block_tables [M, nb] must be int64");
  const int64_t nb = block_tables.size(1), slots_per_head = kv_pool.size(1) * bs;
  const int64_t g = num_heads / kvh;
  const int64_t* st = slots.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(cl[m] >= 1 && cl[m] <= nb * bs, "context length ", cl[m], " outside the table");
    TORCH_CHECK(st[m] >= 0 && st[m] < slots_per_head, "slot outside the pool");
  }
  const bool tree = tree_start.numel() > 0;
  TORCH_CHECK(!tree || (tree_start.scalar_type() == at::kLong && tree_start.numel() == M &&
                        tree_bits.scalar_type() == at::kLong && tree_bits.numel() == M &&
                        tree_start.is_contiguous() && tree_bits.is_contiguous()),
              "tree_start and tree_bits must be int64 [M], or both empty");
  const int64_t* tsp = tree ? tree_start.data_ptr<int64_t>() : nullptr;
  const int64_t* tbp = tree ? tree_bits.data_ptr<int64_t>() : nullptr;
  for (int64_t m = 0; tree && m < M; ++m)
    TORCH_CHECK(tsp[m] >= 0 && cl[m] - tsp[m] <= 63, "a tree row's window exceeds 63 nodes");

  at::Tensor out = x.clone();
  float* xr = out.data_ptr<float>();
  const int64_t widest = std::max({qkv_n, gu_n, D, num_heads * hd});
  std::vector<float> h(M * std::max(D, inter)), big(M * widest), attn(M * num_heads * hd);
  const int64_t widest_in = std::max({D, inter, num_heads * hd});
  std::vector<float> work(M * (widest_in + widest_in / kGroup));

  // Each projection shows in a profiler as `refkern::q4_gemm` or `refkern::f32_gemm`, as
  // the standalone ops do.
  auto gemm = [&](const float* in, int i, float* dst) {
    if (dense(i)) {
      RECORD_FUNCTION("refkern::f32_gemm", std::vector<c10::IValue>());
      f32_matmul(in, M, w[i], dst);
    } else {
      RECORD_FUNCTION("refkern::q4_gemm", std::vector<c10::IValue>());
      q4_matmul(in, M, w[i], w[i + 1], w[i + 2], dst, work.data());
    }
  };
  auto rms_norm = [&](const float* weight, float* dst) {
    for (int64_t m = 0; m < M; ++m) {
      const float* row = xr + m * D;
      const float ss = dot(row, row, D);
      const float inv = 1.0f / std::sqrt(ss / D + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) dst[m * D + i] = row[i] * inv * weight[i];
    }
  };

  // Attention block.
  rms_norm(w[0].data_ptr<float>(), h.data());
  gemm(h.data(), 1, big.data());
  float* pool = kv_pool.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = hd / 2;
  std::vector<float> rotated(hd);
  for (int64_t m = 0; m < M; ++m) {
    float* row = big.data() + m * qkv_n;
    for (int64_t head = 0; head < num_heads + kvh; ++head) {  // RoPE on query and key heads
      float* v = row + head * hd;
      for (int64_t i = 0; i < hd; ++i)
        rotated[i] = v[i] * cp[m * hd + i] + v[(i + half) % hd] * sp[m * hd + i];
      std::copy(rotated.begin(), rotated.end(), v);
    }
    for (int64_t head = 0; head < kv2; ++head) {  // keys then values into the pool
      std::copy(row + (num_heads + head) * hd, row + (num_heads + head + 1) * hd,
                pool + (head * slots_per_head + st[m]) * hd);
    }
  }
  int64_t longest = 0;
  for (int64_t m = 0; m < M; ++m) longest = std::max(longest, cl[m]);
  const float sc = static_cast<float>(attn_scale);
  at::parallel_for(0, M * num_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(longest);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t / num_heads, qh = t % num_heads, kh = qh / g, len = cl[m];
      const float* q = big.data() + m * qkv_n + qh * hd;
      const float* keys = pool + kh * slots_per_head * hd;
      const float* values = pool + (kvh + kh) * slots_per_head * hd;
      const int64_t ts = tree ? tsp[m] : len;
      const uint64_t bits = tree ? static_cast<uint64_t>(tbp[m]) : 0;
      float top = -INFINITY;
      for (int64_t pos = 0; pos < len; ++pos) {
        if (pos >= ts && !((bits >> (pos - ts)) & 1)) {  // not an ancestor: weight exactly 0
          p[pos] = -INFINITY;
          continue;
        }
        const float* k = keys + (bt[m * nb + pos / bs] * bs + pos % bs) * hd;
        p[pos] = dot(q, k, hd) * sc;
        top = std::max(top, p[pos]);
      }
      const float total = exp_shifted(p.data(), len, top);
      float* o = attn.data() + (m * num_heads + qh) * hd;
      std::fill(o, o + hd, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* v = values + (bt[m * nb + pos / bs] * bs + pos % bs) * hd;
        const float weight = p[pos] / total;
        for (int64_t i = 0; i < hd; ++i) o[i] += weight * v[i];
      }
    }
  });
  gemm(attn.data(), 4, big.data());
  for (int64_t i = 0; i < M * D; ++i) xr[i] += big[i];

  // MLP block.
  rms_norm(w[7].data_ptr<float>(), h.data());
  gemm(h.data(), 8, big.data());
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = big.data() + m * gu_n;
    silu_mul(gate, gate + inter, h.data() + m * inter, inter);
  }
  gemm(h.data(), 11, big.data());
  for (int64_t i = 0; i < M * D; ++i) xr[i] += big[i];
  return out;
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

TORCH_LIBRARY(refkern, m) {
  m.def("q4_gemm(Tensor x, Tensor packed, Tensor scale, Tensor minimum) -> Tensor");
  m.def("q8_gemm(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("f32_gemm(Tensor x, Tensor weight) -> Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor[] weights, Tensor cos, Tensor sin, Tensor(a!) kv_pool, "
      "Tensor slots, Tensor block_tables, Tensor context_lens, Tensor tree_start, "
      "Tensor tree_bits, int num_heads, float eps, float attn_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(refkern, CPU, m) {
  m.impl("q4_gemm", q4_gemm);
  m.impl("q8_gemm", q8_gemm);
  m.impl("f32_gemm", f32_gemm);
  m.impl("decode_layer", decode_layer);
}
