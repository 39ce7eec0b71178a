// Int8-activation GEMMs (int8.cpp): the entry points other kernel sources may call.
#pragma once

#include <cstdint>

namespace refkern {

// Output rows per block of the packed layouts: one int32 lane per output row in a 512-bit
// register (two 256-bit halves on AVX2).
constexpr int64_t kI8BlockRows = 16;
// Inputs per 4-bit group (one scale and one minimum per output row and group).
constexpr int64_t kI8Group = 32;
// Bytes of one q4_i8 (block, group) chunk: 256 of nibbles, 16 float16 scales, 16 minima.
constexpr int64_t kQ4I8ChunkBytes = 320;
// Bytes after a q8_i8 block's weights: 16 float32 scales and 16 int32 row sums.
constexpr int64_t kQ8I8TailBytes = 128;

// y [M, N] (row stride N) = x [M, K] @ W.T with int4 W in the q4_i8 layout (`pack_q4_i8` in
// kernels/int8.py): ceil(N / 16) blocks of K / 32 chunks. Each activation row is quantised to
// int8 with one scale (amax / 127); per group the int8 x int4 products sum in int32, then
// y = a * sum_g (scale * isum_g + minimum * xsum_g) with xsum_g the group's sum of the int8
// activations. K is a multiple of 32. Splits the blocks over torch's intra-op threads.
void q4_i8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                  float* y);

// The same for int8 W with one float32 scale per output row, in the q8_i8 layout
// (`pack_q8_i8`): ceil(N / 16) blocks of ceil(K / 4) * 64 weight bytes, then the block's
// scales and row sums. Any K up to 65536.
void q8_i8_matmul(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N,
                  float* y);

}  // namespace refkern
