// Paged attention for decode rows: one query token per sequence, read straight from the
// per-layer KV pool through each row's block table.
//
// refkern::paged_attention_decode(q [T, h, hd], kv [T, 2 kvh, hd] or empty, kv_pool
//   [2 kvh, num_blocks, block_size, hd], slots [T], block_tables [T, nb], context_lens [T],
//   scale, kv_scales [2 kvh, num_blocks, block_size] or None) -> out [T, h, hd] in q's dtype.
//   q and kv are float32 or bfloat16 (the same); slots, block_tables and context_lens int64.
//   The pool holds q's dtype, or (the storage formats of kv_dtype.py) bfloat16, float16, or
//   int8 or float8_e4m3fn with a float32 scale per row of hd values in kv_scales (value x
//   scale is the stored number). The pool holds key heads then value heads, each head's
//   blocks contiguous (the layout `kv_pool_shape` in attention.py names). When kv is given,
//   row t's keys and values are first stored at slot slots[t] (block * block_size + offset) of
//   every head, converted to the pool's dtype (int8 and fp8 rows quantised: scale = absmax /
//   127 or / 448, the values rounded as torch rounds them); then row t's query head j attends
//   to positions 0 .. context_lens[t] - 1 of kv head j / (h / kvh), where position p lives in
//   block block_tables[t, p / block_size] at offset p % block_size.
//
// Work is split over (row, kv head): the h / kvh query heads that share a kv head read each
// key and value row once, so GQA costs no extra memory traffic. Scores, softmax (two passes:
// max, then exp and sum) and the weighted sum of values are float32 whatever the pool holds:
// bfloat16 rows are widened in registers, or (AVX-512 BF16) bfloat16 keys meet the bfloat16
// query in the bf16 dot-product instruction, whose products are exact and sums float32.
// float16, int8 and fp8 rows are widened in registers too (fp8 e4m3 bytes are moved into
// float16 bit positions, which F16C widens exactly, subnormals included, then times 2^8); a
// row's scale multiplies its key's dot product and its value's softmax weight, so no row of
// the pool is dequantised in memory. A
// block table scatters a sequence over the pool, so rows are prefetched ahead of use. Tasks
// go to threads in contiguous runs of equal total context, so a batch of short and long
// contexts keeps every thread busy.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_formats.h"

namespace {

// The storage formats' reading and writing (to_float, widen8, store_row, ...).
using namespace refkern;

// Query heads of one kv head handled together (a group larger than this is split: each
// part reads the kv head's rows again).
constexpr int kMaxGroup = 8;
// How many positions ahead of use the passes ask for key and value rows: a DRAM miss takes
// longer than a few positions' arithmetic.
constexpr int64_t kPrefetchAhead = 48;

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vtop(Vec v) { return _mm512_reduce_max_ps(v); }
// Any storage format's kLanes values (kv_formats.h), or float32 ones, widened.
template <typename S>
inline Vec vload(const S* p) { return widen16(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }

// e^x per lane, within about 2 ulp of expf for x in [-87, 88]; 0 below -87 (and for -inf).
// e^x = 2^n e^r, n = round(x log2 e), |r| <= ln 2 / 2, e^r by Cephes' expf polynomial.
inline Vec vexp(Vec x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  Vec poly = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  poly = _mm512_add_ps(_mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i two_n =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, poly, _mm512_castsi512_ps(two_n));
}
#else
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vtop(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <typename S>
inline Vec vload(const S* p) { return widen8(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }

inline Vec vexp(Vec x) {  // as the AVX-512 version
  const Vec live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  Vec poly = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
  poly = _mm256_add_ps(_mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(poly, _mm256_castsi256_ps(two_n)), live);
}
#endif

// The kLanes sums of d[0 .. kLanes - 1], in order, in one vector: a transposing reduction
// (about 3 operations a sum where a horizontal sum of each takes 8).
#define REFKERN_INLINE inline __attribute__((always_inline))
#if defined(__AVX512F__)
REFKERN_INLINE Vec transpose_sum(const Vec* d) {
  Vec pairs[8], quads[4], octs[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of a, b, c, d
    quads[i] = _mm512_add_ps(
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // lanes 0 + 1 and 2 + 3 of two quads
    octs[i] = _mm512_add_ps(
        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(octs[0], octs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
REFKERN_INLINE Vec transpose_sum(const Vec* d) {
  Vec pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm256_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    quads[i] = _mm256_add_ps(
        _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#endif

// Ask for rows [p0, p1) of a head's positions ahead of use (into L1 with kToL1, L2 with
// kToL2): a table's blocks lie anywhere in the pool, so the hardware prefetcher stalls at
// every block start.
constexpr int kToL1 = 3, kToL2 = 2;  // __builtin_prefetch's locality (_MM_HINT_T0, _T1)
template <int Locality, typename S>
inline void prefetch_rows(const S* base, const int64_t* offsets, int64_t p0, int64_t p1,
                          int64_t hd) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t i = 0; i < hd; i += 64 / sizeof(S))
      __builtin_prefetch(base + offsets[p] + i, 0, Locality);
}

// Pool offsets (elements within one head) of positions 0 .. len - 1 through a block table:
// computed once a task, so the passes below do no division.
inline void row_offsets(const int64_t* table, int64_t len, int64_t block_size, int64_t hd,
                        int64_t* offsets) {
  for (int64_t b = 0, p = 0; p < len; ++b) {
    const int64_t base = table[b] * block_size * hd;
    for (int64_t j = 0; j < block_size && p < len; ++j, ++p) offsets[p] = base + j * hd;
  }
}

// The dot products of one query head q with the n <= kLanes key rows at `offsets`, in one
// vector (hd a multiple of kLanes). The loop runs along hd outside and over the rows inside,
// so kLanes independent sums are in flight; lanes past n repeat row 0 and are not stored.
template <typename S>
REFKERN_INLINE Vec chunk_dots(const float* q, const S* keys, const int64_t* offsets, int64_t n,
                      int64_t hd) {
  const S* k[kLanes];
  for (int j = 0; j < kLanes; ++j) k[j] = keys + offsets[j < n ? j : 0];
  Vec d[kLanes];
  for (int j = 0; j < kLanes; ++j) d[j] = vzero();
  for (int64_t i = 0; i < hd; i += kLanes) {
    const Vec qi = vload(q + i);
    for (int j = 0; j < kLanes; ++j) d[j] = vfma(qi, vload(k[j] + i), d[j]);
  }
  return transpose_sum(d);
}

#if defined(__AVX512BF16__)
// The same for a bfloat16 query and keys with the bf16 dot-product instruction (hd a multiple
// of 32): each product is exact in float32 and the sums are float32.
REFKERN_INLINE Vec chunk_dots_bf16(const uint16_t* q, const uint16_t* keys, const int64_t* offsets,
                           int64_t n, int64_t hd) {
  const uint16_t* k[kLanes];
  for (int j = 0; j < kLanes; ++j) k[j] = keys + offsets[j < n ? j : 0];
  Vec d[kLanes];
  for (int j = 0; j < kLanes; ++j) d[j] = vzero();
  for (int64_t i = 0; i < hd; i += 32) {
    const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
    for (int j = 0; j < kLanes; ++j)
      d[j] = _mm512_dpbf16_ps(d[j], qi, (__m512bh)_mm512_loadu_si512(k[j] + i));
  }
  return transpose_sum(d);
}
#endif

// scores[g, p] = q[g] . key[p] for the g query heads (float32 in qf, or bfloat16 in q_bf16
// when that is given: bfloat16 keys) and positions p < len, kLanes positions at a time, every
// head before the next positions so each key row is read from memory once; times kscale[p]
// when given (kLanes floats readable past len). Value rows are fetched into L2 on the way,
// ready for the weighted sum.
template <typename S>
void key_scores(int g, const float* qf, const uint16_t* q_bf16, const S* keys,
                const S* values, const int64_t* offsets, const float* kscale, int64_t len,
                int64_t hd, float* scores) {
  for (int64_t p0 = 0; p0 < len; p0 += kLanes) {
    const int64_t n = std::min(kLanes, len - p0);
    const int64_t ahead = std::min(len, p0 + kPrefetchAhead);
    const int64_t ahead_end = std::min(len, p0 + kPrefetchAhead + kLanes);
    prefetch_rows<kToL1>(keys, offsets, ahead, ahead_end, hd);
    prefetch_rows<kToL2>(values, offsets, ahead, ahead_end, hd);
    for (int j = 0; j < g; ++j) {
      Vec s;
#if defined(__AVX512BF16__)
      if (q_bf16 != nullptr) {
        s = chunk_dots_bf16(q_bf16 + j * hd, reinterpret_cast<const uint16_t*>(keys),
                            offsets + p0, n, hd);
      } else
#endif
      {
        (void)q_bf16;
        s = chunk_dots<S>(qf + j * hd, keys, offsets + p0, n, hd);
      }
      if (kscale != nullptr) s = vmul(s, vload(kscale + p0));
      float* out = scores + j * len + p0;
      if (n == kLanes) {
        vstore(out, s);
      } else {
        float lane[kLanes];
        vstore(lane, s);
        std::copy(lane, lane + n, out);
      }
    }
  }
}

// e^(scale * a[i] - shift) in place for i < n, with shift the largest scale * a[i]; returns
// 1 / their sum. The tail runs through the vector code too, so a position's weight does not
// depend on where it falls.
inline float softmax_numerators(float* a, int64_t n, float scale) {
  const Vec sc = vset1(scale);
  Vec top = vset1(-INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = vmax(top, vload(a + i));
  float shift = vtop(top);
  for (; i < n; ++i) shift = std::max(shift, a[i]);
  const Vec s = vset1(shift * scale);
  Vec total = vzero();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const Vec e = vexp(vsub(vmul(vload(a + i), sc), s));
    vstore(a + i, e);
    total = vadd(total, e);
  }
  float sum = vsum(total);
  if (i < n) {
    float lane[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) lane[j] = i + j < n ? a[i + j] : -INFINITY;
    vstore(lane, vexp(vsub(vmul(vload(lane), sc), s)));
    for (int64_t j = 0; i + j < n; ++j) sum += (a[i + j] = lane[j]);
  }
  return 1.0f / sum;
}

// acc[g] = inv_sum[g] * sum_p weights[g, p] value[p] for G heads: NC vectors of hd at a
// time (hd a multiple of NC * kLanes), G * NC accumulators in registers.
template <int G, int NC, typename S>
void weigh_values(const float* weights, int64_t len, const S* values, const int64_t* offsets,
                  int64_t hd, const float* inv_sum, float* acc) {
  for (int64_t c0 = 0; c0 < hd; c0 += NC * kLanes) {
    Vec sum[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) sum[g][c] = vzero();
    for (int64_t p = 0; p < len; ++p) {
      if (c0 == 0 && p + kLanes < len)
        prefetch_rows<kToL1>(values, offsets, p + kLanes, p + kLanes + 1, hd);
      const S* v = values + offsets[p] + c0;
      Vec row[NC];
      for (int c = 0; c < NC; ++c) row[c] = vload(v + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const Vec w = vset1(weights[g * len + p]);
        for (int c = 0; c < NC; ++c) sum[g][c] = vfma(w, row[c], sum[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c)
        vstore(acc + g * hd + c0 + c * kLanes, vmul(sum[g][c], vset1(inv_sum[g])));
  }
}

// Vectors of hd per pass: the most of 8, 4, 2, 1 that divides hd / kLanes and keeps the
// G * NC accumulators, a row and a weight within the 32 AVX-512 (16 AVX2) registers.
inline int chunks_per_pass(int group, int64_t hd) {
  const int budget = kLanes == 16 ? 24 : 12;
  for (int nc : {8, 4, 2})
    if (group * nc + nc <= budget && (hd / kLanes) % nc == 0) return nc;
  return 1;
}

template <int G, typename S>
void weigh_values_nc(int nc, const float* weights, int64_t len, const S* values,
                     const int64_t* offsets, int64_t hd, const float* inv_sum, float* acc) {
  switch (nc) {
    case 8: weigh_values<G, 8, S>(weights, len, values, offsets, hd, inv_sum, acc); break;
    case 4: weigh_values<G, 4, S>(weights, len, values, offsets, hd, inv_sum, acc); break;
    case 2: weigh_values<G, 2, S>(weights, len, values, offsets, hd, inv_sum, acc); break;
    default: weigh_values<G, 1, S>(weights, len, values, offsets, hd, inv_sum, acc); break;
  }
}

template <typename S>
void weigh_values_group(int group, const float* weights, int64_t len, const S* values,
                        const int64_t* offsets, int64_t hd, const float* inv_sum, float* acc) {
  const int nc = chunks_per_pass(group, hd);
  switch (group) {
#define REFKERN_GROUP(G)                                                               \
  case G:                                                                              \
    weigh_values_nc<G, S>(nc, weights, len, values, offsets, hd, inv_sum, acc); \
    break;
    REFKERN_GROUP(1) REFKERN_GROUP(2) REFKERN_GROUP(3) REFKERN_GROUP(4)
    REFKERN_GROUP(5) REFKERN_GROUP(6) REFKERN_GROUP(7) REFKERN_GROUP(8)
#undef REFKERN_GROUP
    default: TORCH_CHECK(false, "a query group of ", group, " heads");
  }
}

// One task in scalar code, for head sizes the vector passes do not take; kscale and vscale
// (null for unscaled pools) as in `key_scores` and `scale_weights`.
template <typename S>
void attend_scalar(int group, const float* q, const S* keys, const S* values,
                   const int64_t* offsets, const float* kscale, const float* vscale,
                   int64_t len, int64_t hd, float scale, float* scores, float* acc) {
  for (int g = 0; g < group; ++g) {
    float* row = scores + g * len;
    for (int64_t p = 0; p < len; ++p) {
      float s = 0.0f;
      for (int64_t i = 0; i < hd; ++i) s += q[g * hd + i] * to_float(keys[offsets[p] + i]);
      row[p] = kscale != nullptr ? s * kscale[p] : s;
    }
    const float inv_sum = softmax_numerators(row, len, scale);
    if (vscale != nullptr)
      for (int64_t p = 0; p < len; ++p) row[p] *= vscale[p];
    for (int64_t i = 0; i < hd; ++i) {
      float sum = 0.0f;
      for (int64_t p = 0; p < len; ++p) sum += row[p] * to_float(values[offsets[p] + i]);
      acc[g * hd + i] = sum * inv_sum;
    }
  }
}

// weights[g, p] *= vscale[p] for the g heads: a value row's scale folded into its weight.
inline void scale_weights(int g, int64_t len, const float* vscale, float* weights) {
  for (int j = 0; j < g; ++j) {
    float* w = weights + j * len;
    int64_t p = 0;
    for (; p + kLanes <= len; p += kLanes) vstore(w + p, vmul(vload(w + p), vload(vscale + p)));
    for (; p < len; ++p) w[p] *= vscale[p];
  }
}

// Q: q's, kv's and out's element (float, or uint16_t for bfloat16); S: the pool's.
template <typename Q, typename S>
void decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_pool,
                      float* pool_scales, const int64_t* slots, const int64_t* tables,
                      int64_t table_stride, const int64_t* lens, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t kvh = kv_pool.size(0) / 2, num_blocks = kv_pool.size(1);
  const int64_t block_size = kv_pool.size(2);
  S* pool = reinterpret_cast<S*>(kv_pool.data_ptr());
  const int64_t num_slots = num_blocks * block_size;
  const int64_t head_stride = num_slots * hd;  // one pool head
  if (kv.numel()) {  // store every row's keys and values before any row attends
    const Q* src = reinterpret_cast<const Q*>(kv.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t head = 0; head < 2 * kvh; ++head)
        store_row(src + t * kv.stride(0) + head * kv.stride(1), hd,
                  pool + head * head_stride + slots[t] * hd,
                  kScaled<S> ? pool_scales + head * num_slots + slots[t] : nullptr);
  }
  const int64_t group = heads / kvh;
  const int64_t parts = (group + kMaxGroup - 1) / kMaxGroup;
  const int64_t tasks = T * kvh * parts;
  // Contiguous runs of tasks of about equal cost (context length plus a constant) per thread.
  std::vector<int64_t> cost_end(tasks);
  int64_t total = 0, longest = 1;
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t len = lens[task / (kvh * parts)];
    longest = std::max(longest, len);
    cost_end[task] = (total += len + 16);
  }
  const bool vector = hd % kLanes == 0;
#if defined(__AVX512BF16__)
  const bool bf16_dots =
      std::is_same<S, uint16_t>::value && std::is_same<Q, uint16_t>::value && hd % 32 == 0;
#else
  const bool bf16_dots = false;
#endif
  const float sc = static_cast<float>(scale);
  const Q* qp = reinterpret_cast<const Q*>(q.data_ptr());
  Q* op = reinterpret_cast<Q*>(out.data_ptr());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(kMaxGroup * longest), qf(kMaxGroup * hd), acc(kMaxGroup * hd);
    // A scaled pool's row scales of the task's positions (keys, values), kLanes past len.
    std::vector<float> kscale(kScaled<S> ? longest + kLanes : 0, 0.0f);
    std::vector<float> vscale(kScaled<S> ? longest + kLanes : 0, 0.0f);
    // Row offsets of the task's sequence, and of the next task's when that is another one.
    std::vector<int64_t> offsets(longest), next_offsets(longest);
    for (int64_t worker = first; worker < last; ++worker) {
      const int64_t lo = worker * total / threads, hi = (worker + 1) * total / threads;
      int64_t task = std::upper_bound(cost_end.begin(), cost_end.end(), lo) - cost_end.begin();
      int64_t offsets_row = -1, next_row = -1;
      for (; task < tasks && cost_end[task] <= hi; ++task) {
        const int64_t t = task / (kvh * parts), kh = task / parts % kvh, part = task % parts;
        const int64_t h0 = kh * group + part * kMaxGroup, len = lens[t];
        const int g = static_cast<int>(std::min<int64_t>(kMaxGroup, kh * group + group - h0));
        const Q* q_row = qp + t * q.stride(0) + h0 * hd;  // g heads of hd, contiguous
        const S* keys = pool + kh * head_stride;
        const S* values = pool + (kvh + kh) * head_stride;
        if (t == next_row) {
          offsets.swap(next_offsets);
        } else if (t != offsets_row) {
          row_offsets(tables + t * table_stride, len, block_size, hd, offsets.data());
        }
        offsets_row = t;
        prefetch_rows<kToL1>(keys, offsets.data(), 0, std::min(len, kPrefetchAhead), hd);
        prefetch_rows<kToL2>(values, offsets.data(), 0, std::min(len, kPrefetchAhead), hd);
        for (int64_t i = 0; i < g * hd; ++i) qf[i] = to_float(q_row[i]);
        const float* ks = nullptr;
        const float* vs = nullptr;
        if constexpr (kScaled<S>) {  // slot = offset / hd within a head
          const float* k_head = pool_scales + kh * num_slots;
          const float* v_head = pool_scales + (kvh + kh) * num_slots;
          for (int64_t p = 0; p < len; ++p) {
            kscale[p] = k_head[offsets[p] / hd];
            vscale[p] = v_head[offsets[p] / hd];
          }
          ks = kscale.data();
          vs = vscale.data();
        }
        if (!vector) {
          attend_scalar<S>(g, qf.data(), keys, values, offsets.data(), ks, vs, len, hd, sc,
                           scores.data(), acc.data());
        } else {
          const uint16_t* q_bf16 =
              bf16_dots ? reinterpret_cast<const uint16_t*>(q_row) : nullptr;
          key_scores<S>(g, qf.data(), q_bf16, keys, values, offsets.data(), ks, len, hd,
                        scores.data());
          float inv_sum[kMaxGroup];
          for (int j = 0; j < g; ++j)
            inv_sum[j] = softmax_numerators(scores.data() + j * len, len, sc);
          if (vs != nullptr) scale_weights(g, len, vs, scores.data());
          if (task + 1 < tasks && cost_end[task + 1] <= hi) {  // the next task's first rows
            const int64_t nt = (task + 1) / (kvh * parts), nkh = (task + 1) / parts % kvh;
            next_row = -1;
            if (nt != t) {
              row_offsets(tables + nt * table_stride, lens[nt], block_size, hd,
                          next_offsets.data());
              next_row = nt;
            }
            const int64_t* ahead = nt != t ? next_offsets.data() : offsets.data();
            const int64_t rows = std::min(lens[nt], kPrefetchAhead);
            prefetch_rows<kToL2>(pool + nkh * head_stride, ahead, 0, rows, hd);
            prefetch_rows<kToL2>(pool + (kvh + nkh) * head_stride, ahead, 0, rows, hd);
          }
          weigh_values_group<S>(g, scores.data(), len, values, offsets.data(), hd, inv_sum,
                                acc.data());
        }
        for (int64_t i = 0; i < g * hd; ++i) from_float(acc[i], op + (t * heads + h0) * hd + i);
      }
    }
  });
}

}  // namespace

namespace {

bool same_dtype(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type();
}

bool is_scaled(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }

// decode_attention<Q, S> for the pool's dtype S.
template <typename Q>
void dispatch_pool(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_pool,
                   float* scales, const int64_t* slot, const int64_t* tables,
                   int64_t table_stride, const int64_t* lens, double scale, at::Tensor& out) {
  switch (kv_pool.scalar_type()) {
#define REFKERN_POOL(TYPE, S)                                                             \
  case TYPE:                                                                              \
    decode_attention<Q, S>(q, kv, kv_pool, scales, slot, tables, table_stride, lens, scale, \
                           out);                                                          \
    break;
    REFKERN_POOL(at::kFloat, float)
    REFKERN_POOL(at::kBFloat16, uint16_t)
    REFKERN_POOL(at::kHalf, c10::Half)
    REFKERN_POOL(at::kChar, int8_t)
    REFKERN_POOL(at::kFloat8_e4m3fn, c10::Float8_e4m3fn)
#undef REFKERN_POOL
    default: TORCH_CHECK(false, "no decode path for a ", kv_pool.scalar_type(), " pool");
  }
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& kv,
                                  const at::Tensor& kv_pool, const at::Tensor& slots,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  double scale, const std::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(kv_pool.dim() == 4 && kv_pool.size(0) % 2 == 0 && kv_pool.size(0) > 0 &&
                  kv_pool.is_contiguous(),
              "kv_pool must be a contiguous [2 * kv_heads, num_blocks, block_size, head_dim] tensor");
  const at::ScalarType pool_type = kv_pool.scalar_type();
  TORCH_CHECK(pool_type == at::kFloat || pool_type == at::kBFloat16 || pool_type == at::kHalf ||
                  is_scaled(pool_type),
              "kv_pool must be float32, bfloat16, float16, int8 or float8_e4m3fn, got ",
              pool_type);
  const int64_t kvh = kv_pool.size(0) / 2, num_blocks = kv_pool.size(1);
  const int64_t block_size = kv_pool.size(2), hd = kv_pool.size(3);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == hd && q.stride(2) == 1 && q.stride(1) == hd &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  (pool_type != at::kFloat || same_dtype(q, kv_pool)),
              "q must be [T, heads, head_dim] with contiguous heads, float32 or bfloat16 (in the "
              "pool's dtype when the pool is float32)");
  const int64_t T = q.size(0), heads = q.size(1);
  TORCH_CHECK(heads > 0 && heads % kvh == 0, "query heads (", heads,
              ") must be a multiple of the pool's kv heads (", kvh, ")");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 &&
                  context_lens.size(0) == T && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 [T] tensor");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == T && block_tables.stride(1) == 1,
              "block_tables must be an int64 [T, nb] tensor with contiguous rows");
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  float* scales = nullptr;
  if (is_scaled(pool_type)) {
    TORCH_CHECK(kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat &&
                    kv_scales->is_contiguous() && kv_scales->dim() == 3 &&
                    kv_scales->size(0) == 2 * kvh && kv_scales->size(1) == num_blocks &&
                    kv_scales->size(2) == block_size,
                "an int8 or float8 pool needs kv_scales, a contiguous float32 [2 * kv_heads, "
                "num_blocks, block_size] tensor");
    scales = kv_scales->data_ptr<float>();
  } else {
    TORCH_CHECK(!kv_scales.has_value(), "kv_scales go with int8 and float8 pools only, not ",
                pool_type);
  }
  const bool store = kv.numel() > 0;
  if (store) {
    TORCH_CHECK(kv.dim() == 3 && kv.size(0) == T && kv.size(1) == 2 * kvh && kv.size(2) == hd &&
                    kv.stride(2) == 1 && kv.stride(1) == hd && same_dtype(kv, q),
                "kv must be [T, 2 * kv_heads, head_dim] in q's dtype (the pool's dtype) with "
                "contiguous heads");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T &&
                    slots.is_contiguous(),
                "slots must be a contiguous int64 [T] tensor when kv is given");
  }
  const int64_t nb = block_tables.size(1), table_stride = block_tables.stride(0);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* slot = store ? slots.data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lens[t] >= 1 && lens[t] <= nb * block_size, "row ", t, "'s context length ",
                lens[t], " is outside its block table of ", nb, " blocks");
    for (int64_t b = 0; b < (lens[t] + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[t * table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "row ", t, "'s block table names block ",
                  block, ", outside the pool's ", num_blocks);
    }
    TORCH_CHECK(!store || (slot[t] >= 0 && slot[t] < num_blocks * block_size), "row ", t,
                "'s slot ", store ? slot[t] : 0, " is outside the pool");
  }
  at::Tensor out = at::empty({T, heads, hd}, q.options());
  if (T == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    dispatch_pool<float>(q, kv, kv_pool, scales, slot, tables, table_stride, lens, scale, out);
  } else {
    dispatch_pool<uint16_t>(q, kv, kv_pool, scales, slot, tables, table_stride, lens, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(refkern, m) {
  m.def(
      "paged_attention_decode(Tensor q, Tensor kv, Tensor(a!) kv_pool, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, float scale, Tensor(b!)? kv_scales=None) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(refkern, CPU, m) { m.impl("paged_attention_decode", paged_attention_decode); }
