// refkern::decode_layer: one Llama decoder layer for a few rows in one call (see below).
#include <ATen/record_function.h>
#include <torch/library.h>

#include "kv_formats.h"
#include "simd.h"

namespace refkern {
namespace {

// The KV pool holds float32, bfloat16, float16, or int8 or fp8 e4m3 values with a float32
// scale per row (kv_formats.h). Rows store into it quantised as `kv_dtype.store_rows` stores
// them, and attention reads them in place, widened in registers: a scaled row's scale
// multiplies its key's dot product and its value's softmax weight, as in the paged decode
// kernel.

// Sum of q[i] * k[i], 8 lanes at a time (for float32 the same sums as simd.h's `dot`); the
// tail one by one.
template <typename S>
inline float kv_dot(const float* q, const S* k, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), widen8(k + i), acc);
  float total = hsum(acc);
  for (; i < n; ++i) total += q[i] * to_float(k[i]);
  return total;
}

// o[i] += weight * v[i] for i < n.
template <typename S>
inline void kv_axpy(float weight, const S* v, float* o, int64_t n) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, widen8(v + i), _mm256_loadu_ps(o + i)));
  for (; i < n; ++i) o[i] += weight * to_float(v[i]);
}

// Stores each row's new keys and values (`qkv` [M, qkv_n], after RoPE, float32) at its slot,
// then attends: attn [M, num_heads * hd] from the queries in `qkv` over the pool. `scales`
// [2 kvh, slots_per_head] is the pool's row scales for int8 and fp8 (S scaled), else null.
template <typename S>
void store_and_attend(S* pool, float* scales, const float* qkv, int64_t qkv_n, float* attn,
                      int64_t M, int64_t num_heads, int64_t kvh, int64_t hd, int64_t bs,
                      int64_t nb, int64_t slots_per_head, const int64_t* st, const int64_t* cl,
                      const int64_t* bt, const int64_t* tsp, const int64_t* tbp, float sc) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = qkv + m * qkv_n;
    for (int64_t head = 0; head < 2 * kvh; ++head) {  // keys then values into the pool
      const int64_t r = head * slots_per_head + st[m];  // the row (head, slot)
      store_row(row + (num_heads + head) * hd, hd, pool + r * hd,
                kScaled<S> ? scales + r : nullptr);
    }
  }
  int64_t longest = 0;
  for (int64_t m = 0; m < M; ++m) longest = std::max(longest, cl[m]);
  const int64_t g = num_heads / kvh;
  at::parallel_for(0, M * num_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(longest);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t / num_heads, qh = t % num_heads, kh = qh / g, len = cl[m];
      const float* q = qkv + m * qkv_n + qh * hd;
      const S* keys = pool + kh * slots_per_head * hd;
      const S* values = pool + (kvh + kh) * slots_per_head * hd;
      const float* kscale = kScaled<S> ? scales + kh * slots_per_head : nullptr;
      const float* vscale = kScaled<S> ? scales + (kvh + kh) * slots_per_head : nullptr;
      const int64_t ts = tsp ? tsp[m] : len;
      const uint64_t bits = tsp ? static_cast<uint64_t>(tbp[m]) : 0;
      float top = -INFINITY;
      for (int64_t pos = 0; pos < len; ++pos) {
        if (pos >= ts && !((bits >> (pos - ts)) & 1)) {  // not an ancestor: weight exactly 0
          p[pos] = -INFINITY;
          continue;
        }
        const int64_t slot = bt[m * nb + pos / bs] * bs + pos % bs;
        float dot = kv_dot(q, keys + slot * hd, hd);
        if constexpr (kScaled<S>) dot *= kscale[slot];
        p[pos] = dot * sc;
        top = std::max(top, p[pos]);
      }
      const float total = exp_shifted(p.data(), len, top);
      float* o = attn + (m * num_heads + qh) * hd;
      std::fill(o, o + hd, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        if (p[pos] == 0.f) continue;  // masked (or underflowed): adds nothing
        const int64_t slot = bt[m * nb + pos / bs] * bs + pos % bs;
        float weight = p[pos] / total;
        if constexpr (kScaled<S>) weight *= vscale[slot];
        kv_axpy(weight, values + slot * hd, o, hd);
      }
    }
  });
}

enum class Proj { kInt4, kFloat32, kBFloat16 };

Proj kind_of(const at::Tensor& weight) {
  if (weight.scalar_type() == at::kFloat) return Proj::kFloat32;
  if (weight.scalar_type() == at::kBFloat16) return Proj::kBFloat16;
  return Proj::kInt4;
}

// One Llama decoder layer for M rows with int4, float32 or bfloat16 projections, each row
// attending to every position up to its own (decode rows, prefill chunks, chain drafts: all
// rows' K/V are in the pool before any row attends) or, in a token tree, to those before the
// tree and its ancestors, in place of the ~45 small torch ops and nine module calls it takes
// in Python (`model.py`):
// RMSNorm, qkv, RoPE (rotate_half pairing, signed sin as `rope_tables` builds it), the new
// K/V stored at `slots`, attention of each row over its `context_lens` positions through its
// block table, o_proj and the residual, RMSNorm, gate_up, silu(gate) * up, down_proj and the
// residual. Returns the new residual stream (float32); writes the KV pool. Activations stay
// float32 throughout; only the pool's stored K/V are rounded to its format.
//
// weights: ln1 [D] float32, qkv (packed, scale, minimum), o (3), ln2 [D] float32, gate_up
// (3), down (3); a float32 or bfloat16 projection is (weight [N, K], then two unused
// tensors) and runs f32_gemm or bf16_gemm.
// kv_pool [2 kvh, blocks, block_size, hd] float32, bfloat16, float16, int8 or float8_e4m3fn,
// with kv_scales [2 kvh, blocks, block_size] float32 for int8 and fp8 (value x scale is the
// stored number; absent for the others); block_tables [M, nb] int64;
// slots, context_lens [M] int64; cos, sin [M, hd] float32. Token trees: tree_start and
// tree_bits [M] int64 (both empty without trees); row m then attends to position p <
// context_lens[m] only if p < tree_start[m] or bit p - tree_start[m] of tree_bits[m] is set.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList w, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& kv_pool,
                        const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, const at::Tensor& tree_start,
                        const at::Tensor& tree_bits, int64_t num_heads, double eps,
                        double attn_scale, const std::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(w.size() == 14, "decode_layer takes 14 weight tensors, got ", w.size());
  const int64_t M = x.size(0), D = x.size(1);
  check_x(x, D, 16);
  for (int i : {0, 7})
    TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].is_contiguous() && w[i].numel() == D,
                "the norm weights must be float32 [D]");
  auto kind = [&](int i) { return kind_of(w[i]); };
  for (int i : {1, 4, 8, 11}) {
    switch (kind(i)) {
      case Proj::kFloat32: check_f32(w[i]); break;
      case Proj::kBFloat16: check_bf16(w[i]); break;
      case Proj::kInt4: check_q4(w[i], w[i + 1], w[i + 2]); break;
    }
  }
  auto in_features = [&](int i) { return kind(i) == Proj::kInt4 ? w[i].size(1) * 2 : w[i].size(1); };
  const int64_t kv2 = kv_pool.size(0), kvh = kv2 / 2, bs = kv_pool.size(2), hd = kv_pool.size(3);
  const int64_t qkv_n = w[1].size(0), gu_n = w[8].size(0), inter = gu_n / 2;
  TORCH_CHECK(qkv_n == (num_heads + kv2) * hd, "qkv rows do not match the heads");
  TORCH_CHECK(in_features(1) == D && in_features(8) == D, "qkv and gate_up take D columns");
  TORCH_CHECK(in_features(4) == num_heads * hd && w[4].size(0) == D, "o_proj shape");
  TORCH_CHECK(in_features(11) == inter && w[11].size(0) == D, "down_proj shape");
  const at::ScalarType pool_type = kv_pool.scalar_type();
  const bool scaled = pool_type == at::kChar || pool_type == at::kFloat8_e4m3fn;
  TORCH_CHECK((scaled || pool_type == at::kFloat || pool_type == at::kBFloat16 ||
               pool_type == at::kHalf) &&
                  kv_pool.is_contiguous() && kv_pool.dim() == 4,
              "kv_pool must be a contiguous float32, bfloat16, float16, int8 or float8_e4m3fn "
              "[2 kvh, blocks, block_size, hd]");
  float* scales = nullptr;
  if (scaled) {
    TORCH_CHECK(kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat &&
                    kv_scales->is_contiguous() &&
                    kv_scales->sizes() == kv_pool.sizes().slice(0, 3),
                "an int8 or float8 pool needs kv_scales, a contiguous float32 [2 kvh, blocks, "
                "block_size] tensor");
    scales = kv_scales->data_ptr<float>();
  } else {
    TORCH_CHECK(!kv_scales.has_value(), "kv_scales go with int8 and float8 pools only, not ",
                pool_type);
  }
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(0) == M &&
                  cos.size(1) == hd && sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos, sin must be float32 [M, hd]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == M &&
                  context_lens.scalar_type() == at::kLong && context_lens.numel() == M &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == M,
              "slots, context_lens [M] and block_tables [M, nb] must be int64");
  const int64_t nb = block_tables.size(1), slots_per_head = kv_pool.size(1) * bs;
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

  // Each projection shows in a profiler as `refkern::q4_gemm`, `refkern::f32_gemm` or
  // `refkern::bf16_gemm`, as the standalone ops do.
  auto gemm = [&](const float* in, int i, float* dst) {
    switch (kind(i)) {
      case Proj::kFloat32: {
        RECORD_FUNCTION("refkern::f32_gemm", std::vector<c10::IValue>());
        f32_matmul(in, M, w[i], dst);
        break;
      }
      case Proj::kBFloat16: {
        RECORD_FUNCTION("refkern::bf16_gemm", std::vector<c10::IValue>());
        bf16_matmul(in, M, w[i], dst);
        break;
      }
      case Proj::kInt4: {
        RECORD_FUNCTION("refkern::q4_gemm", std::vector<c10::IValue>());
        q4_matmul(in, M, w[i], w[i + 1], w[i + 2], dst, work.data());
        break;
      }
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
  }
  const float sc = static_cast<float>(attn_scale);
  auto attend = [&](auto* pool) {
    store_and_attend(pool, scales, big.data(), qkv_n, attn.data(), M, num_heads, kvh, hd, bs, nb,
                     slots_per_head, st, cl, bt, tsp, tbp, sc);
  };
  void* pool = kv_pool.data_ptr();
  switch (pool_type) {
    case at::kFloat: attend(static_cast<float*>(pool)); break;
    case at::kBFloat16: attend(static_cast<uint16_t*>(pool)); break;
    case at::kHalf: attend(static_cast<c10::Half*>(pool)); break;
    case at::kChar: attend(static_cast<int8_t*>(pool)); break;
    default: attend(static_cast<c10::Float8_e4m3fn*>(pool)); break;
  }
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

}  // namespace
}  // namespace refkern

TORCH_LIBRARY_FRAGMENT(refkern, m) {
  m.def(
      "decode_layer(Tensor x, Tensor[] weights, Tensor cos, Tensor sin, Tensor(a!) kv_pool, "
      "Tensor slots, Tensor block_tables, Tensor context_lens, Tensor tree_start, "
      "Tensor tree_bits, int num_heads, float eps, float attn_scale, "
      "Tensor(b!)? kv_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(refkern, CPU, m) { m.impl("decode_layer", refkern::decode_layer); }
