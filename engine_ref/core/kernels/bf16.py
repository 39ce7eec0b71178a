"""bfloat16 weights in the engine's own kernels: `refkern::bf16_gemm` (bf16.cpp) and what
decides when a bfloat16 engine on a CPU runs it and the bfloat16 `refkern::decode_layer`.

A bfloat16 engine holds bf16 weights and a bf16 KV pool. For up to `BF16_SMALL_BATCH_ROWS`
rows it runs one `decode_layer` call per layer (bf16 projections and pool, float32
activations and residual stream inside) and its head through `bf16_gemm`, as a float32
engine does with `f32_gemm`; more rows go to the Python layers and torch's bf16 matmul.
`benchmarks/decode_paths.py` measures the paths against the bf16 weight-streaming floor.
"""

from __future__ import annotations

import torch

from engine_ref.core import kernels

# The most rows a bfloat16 head GEMM or fused layer takes; more go to torch's bf16 matmul.
BF16_SMALL_BATCH_ROWS = 48


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [M, N] = x [M, K] @ weight.T for bfloat16 weight [N, K] (contiguous, any K),
    accumulated in float32; x of any float dtype."""
    return torch.ops.refkern.bf16_gemm(x.float().contiguous(), weight)


def activations_in_bf16() -> bool:
    """Whether the running `bf16_gemm` rounds x to bfloat16 before multiplying: the AVX-512
    BF16 levels multiply with `vdpbf16ps` (exact products, float32 sums); the others widen
    the weights and keep x float32 (bf16.cpp says why)."""
    return kernels.active_isa() in ("avx512-bf16", "amx")


def bf16_ok(weight: torch.Tensor) -> bool:
    """Whether `bf16_gemm` (and `decode_layer`) can take this weight as it is held. As for a
    float32 engine (`kernels.dense_ok`), a first build is not waited for: it runs in the
    background while torch's kernels serve, and a later engine finds the library built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % kernels.F32_K_MULTIPLE == 0
        and kernels.available(build=False)
    )
