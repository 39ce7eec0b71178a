"""Quantized linear layers that run low-bit GEMMs (never a dequantised copy of the matrix).

Modes (`EngineConfig.quantization`):
- `w4a16`: 4-bit weights in groups of 32 along the input dimension, a scale and a minimum per
  group (GGUF Q4_0/Q4_1 blocks as stored, or quantised the Q4_1 way from float weights), run
  by torch's int4 weight-packed matmul (`aten::_weight_int4pack_mm_for_cpu` on CPU,
  `aten::_weight_int4pack_mm` on CUDA) with bfloat16 activations. The CPU kernel also takes
  float32 activations, but through a scalar path ~10x slower than its bf16 one (measured at
  SmolLM2's shapes on AVX2), so activations are cast to bf16 around it. On CPUs where the
  engine's own kernels build (`engine_ref.core.kernels`), calls of at most
  `SMALL_BATCH_ROWS` rows (decode steps) run `refkern::q4_gemm` on a second copy of the
  same 4-bit weights in its own layout, with float32 activations: about twice as fast as
  torch's kernel at one row. Both copies count in the weight bytes.
- `w4a8`: the same 4-bit groups with int8 activations, one scale per activation row,
  through `refkern::q4_i8_gemm` (integer dot products, `kernels/int8.cpp`) at every batch
  size: it was faster than torch's int4 kernel at every row count measured, so one copy of
  the weights, in its own layout, is held. It needs the engine's kernels (CPU).
- `w8a16`: int8 weights with one scale per output channel, `aten::_weight_int8pack_mm` with
  bf16 activations (CPU), or `refkern::q8_gemm` on the same int8 tensor for small calls.
- `w8a8`: int8 per-channel weights and dynamically quantised int8 activations with int32
  accumulation. Where the engine's kernels run: weights within +-127 and one scale per
  activation row, through `refkern::q8_i8_gemm` at every batch size, for every projection
  and the output projection. Otherwise torch's quantized CPU backend (fbgemm,
  `quantized::linear_dynamic`: one activation scale per call, weights within
  +-`W8A8_WEIGHT_LEVEL`) for all but down_proj, which stays W8A16 (`W8A8_KEEPS_A16`).

In every mode the (tied) output projection and the embedding are int8 per row, as the
8-bit token embedding of a Q4_1 GGUF file is: the embedding gathers int8 rows and scales
them, the output projection runs the mode's int8 kernel (int8 activations in w4a8 and
w8a8). Norms stay in the engine's dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.core import kernels
from engine_ref.core.kernels import int8 as int8_kernels

QUANTIZATION_MODES = ("w4a16", "w4a8", "w8a8", "w8a16")
GROUP_SIZE = kernels.GROUP
# Modes whose projections take 4-bit groups (a GGUF file's own Q4_0/Q4_1 blocks where kept).
INT4_MODES = frozenset({"w4a16", "w4a8"})
# Modes whose kernels exist only on the CPU (torch's CPU backends, the engine's own).
_CPU_ONLY = frozenset({"w4a8", "w8a8", "w8a16"})
# Modes that run only on the engine's own kernels (`engine_ref.core.kernels`).
_ENGINE_KERNELS_ONLY = frozenset({"w4a8"})
# The fused projections of one decoder layer and the Hugging Face weights each concatenates.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class QuantizationError(ValueError):
    """A model cannot be quantized as asked; the message names the reason in one sentence."""


@dataclass(frozen=True)
class Int4Groups:
    """Asymmetric 4-bit weights [N, K] in groups along K: w = q * scale + minimum.

    `q` [N, K] uint8 in 0..15; `scale`, `minimum` [N, K // group_size] float32. Q4_1 stores
    exactly this (d, m); Q4_0's (q - 8) * d is scale d, minimum -8 d."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (for tests and references; the layers never call it)."""
        n, k = self.q.shape
        groups = self.q.view(n, -1, self.group_size).float()
        return (groups * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn) -> Int4Groups:
        """The same weights with `fn` (a row permutation) applied to q, scale and minimum."""
        return Int4Groups(fn(self.q), fn(self.scale), fn(self.minimum))

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Row-wise concatenation (fusing q/k/v or gate/up)."""
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.minimum for p in parts]),
        )

    @staticmethod
    def quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Groups:
        """llama.cpp's Q4_1 rule per group: minimum = min, scale = (max - min) / 15, both
        rounded to float16 as Q4_1 stores them, q = round((w - min) / scale) clamped to 15."""
        n, k = weight.shape
        if k % group_size:
            raise QuantizationError(
                f"4-bit groups of {group_size} need an input size divisible by {group_size}, "
                f"got {k}."
            )
        groups = weight.detach().float().reshape(n, k // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).half().float()
        minimum = low.half().float()
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = ((groups - minimum.unsqueeze(-1)) * inverse.unsqueeze(-1) + 0.5).floor()
        q = q.clamp(0, 15).to(torch.uint8).reshape(n, k)
        return Int4Groups(q, scale, minimum)


def int8_per_row(weight: torch.Tensor, max_level: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in -max_level..max_level with one float32 scale per row:
    (q [N, K] int8, scale [N]); w ~ q * scale[:, None]. An all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / max_level, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(1)).clamp(-max_level, max_level).to(torch.int8)
    return q, scale


# fbgemm's AVX2 int8 GEMM sums pairs of uint8 x int8 products in int16 with saturation:
# 2 * 255 * 63 fits, 2 * 255 * 127 does not. W8A8 weights therefore use +-63 (7 bits in int8)
# with full 8-bit activations; on SmolLM2's real activations this measured 3.0% relative error
# against 5.3% for +-127 weights with fbgemm's 7-bit "reduce_range" activations, and the
# full-range pair saturated (2.9% off an exact emulation on random data).
W8A8_WEIGHT_LEVEL = 63
# Projections that w8a8 runs as W8A16: down_proj's input (silu(gate) * up) has the outlier
# channels that one 8-bit activation scale per call cannot hold (LLM.int8, SmoothQuant). On
# the bundled text, SmolLM2's perplexity was 46.8 with it in W8A8, 30.0 in W8A16 (28.1 float).
# One scale per activation row (the engine's kernels) holds them: 29.2 in W8A8, 29.3 in W8A16,
# the same greedy agreement with float32, so there it runs W8A8 like the others.
W8A8_KEEPS_A16 = frozenset({"mlp.down_proj"})
# Modes whose output projection runs int8 activations (`DynamicInt8Linear`); the others run it
# W8A16 (`Int8Linear`).
_INT8_ACTIVATION_HEADS = frozenset({"w4a8", "w8a8"})


class Int4Linear(nn.Module):
    """y = x @ W.T for W held as int4 groups, through torch's int4 weight-packed matmul."""

    def __init__(self, groups: Int4Groups, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = groups.shape
        self.group_size = groups.group_size
        # The kernel computes (q - 8) * scale + zero: zero = minimum + 8 * scale.
        zeros = groups.minimum + 8 * groups.scale
        scale_zeros = torch.stack([groups.scale.t(), zeros.t()], dim=-1)  # [K/G, N, 2]
        self.register_buffer(
            "scale_zeros", scale_zeros.to(device, torch.bfloat16).contiguous(), persistent=False
        )
        q = groups.q.to(torch.int32)
        if device.type == "cuda":
            # CUDA wants two values a byte, the even column in the high nibble [N, K/2].
            nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), inner_k_tiles)
            self._mm = torch.ops.aten._weight_int4pack_mm
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K/2] uint8
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        self.register_buffer("packed", packed, persistent=False)
        self.small = (
            device.type == "cpu"
            and self.group_size == kernels.GROUP
            and self.in_features % kernels.Q4_K_MULTIPLE == 0
            and kernels.available()
        )
        if self.small:
            self.register_buffer("small_packed", kernels.pack_q4(groups.q), persistent=False)
            # float16, as Q4_1 stores them (exact for GGUF blocks and for `quantize`'s).
            self.register_buffer("small_scale", groups.scale.half().contiguous(), persistent=False)
            self.register_buffer("small_min", groups.minimum.half().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.small and rows.shape[0] <= kernels.SMALL_BATCH_ROWS:
            y = kernels.q4_gemm(rows, self.small_packed, self.small_scale, self.small_min)
        else:
            y = self._mm(rows.to(torch.bfloat16), self.packed, self.group_size, self.scale_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """W8A16: y = x @ W.T for int8 per-row W, through `aten::_weight_int8pack_mm` (bf16)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q, persistent=False)
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)
        self.small = (
            q.device.type == "cpu"
            and self.in_features % kernels.Q8_K_MULTIPLE == 0
            and kernels.available()
        )
        if self.small:  # the kernel's float32 scales (the bf16 ones, widened)
            self.register_buffer("small_scale", self.scale.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.small and rows.shape[0] <= kernels.SMALL_BATCH_ROWS:
            y = kernels.q8_gemm(rows, self.weight_int8, self.small_scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(
                rows.to(torch.bfloat16), self.weight_int8, self.scale
            )
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class DynamicInt4Linear(nn.Module):
    """W4A8: y = x @ W.T for W held as int4 groups, each call quantising its activations to
    int8 with one scale per row, through `refkern::q4_i8_gemm` at any batch size. Not an
    `Int4Linear`: the fused decode layer takes those and runs W4A16 arithmetic."""

    def __init__(self, groups: Int4Groups) -> None:
        super().__init__()
        self.out_features, self.in_features = groups.shape
        packed = int8_kernels.pack_q4_i8(groups.q, groups.scale, groups.minimum)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = int8_kernels.q4_i8_gemm(rows, self.packed, self.out_features)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class DynamicInt8Linear(nn.Module):
    """W8A8: int8 per-row weights, activations quantised to int8 by each call, int32
    accumulation, float32 out. Where the engine's kernels run (`engine_kernels`): weights within
    +-127, one activation scale per row, `refkern::q8_i8_gemm` at any batch size. Otherwise
    torch's fbgemm: weights within +-`W8A8_WEIGHT_LEVEL`, activations to uint8 with one scale
    and zero point for the whole call."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.engine_kernels = _int8_kernels_take(weight)
        self.packed_nbytes = 0
        if self.engine_kernels:
            packed = int8_kernels.pack_q8_i8(*int8_per_row(weight))
            self.register_buffer("packed", packed, persistent=False)
            return
        q, scale = int8_per_row(weight, W8A8_WEIGHT_LEVEL)
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch deprecates quantized tensors (issue 184982) but still ships fbgemm's
            # int8 GEMM, which is only reachable through one.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # fbgemm keeps the int8 matrix plus a float64 scale and an int64 zero point per row.
        self.packed_nbytes = q.numel() + 16 * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.engine_kernels:
            y = int8_kernels.q8_i8_gemm(rows, self.packed, self.out_features)
        else:
            y = torch.ops.quantized.linear_dynamic(rows.float(), self._packed, False)  # 8 bits
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _int8_kernels_take(weight: torch.Tensor) -> bool:
    """Whether `refkern::q8_i8_gemm` runs a W8A8 layer of this weight."""
    return (
        weight.device.type == "cpu"
        and weight.shape[1] <= int8_kernels.Q8_MAX_K
        and kernels.available()
    )


class Int8Embedding(nn.Module):
    """Embedding rows gathered from int8 [V, D] and scaled per row to `dtype`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight_int8", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight_int8).to(self.dtype)
        return rows * self.scale[ids].unsqueeze(-1).to(self.dtype)


def check_supported(mode: str | None, device: torch.device) -> None:
    """Raise QuantizationError when `mode` cannot run on `device`."""
    if mode is None:
        return
    if mode not in QUANTIZATION_MODES:
        raise QuantizationError(
            f"Unknown quantization {mode!r}; use one of {', '.join(QUANTIZATION_MODES)}."
        )
    if device.type != "cpu" and mode in _CPU_ONLY:
        raise QuantizationError(
            f"quantization {mode} runs on CPU only (CPU int8 kernels); use w4a16 on {device.type}."
        )
    if mode in _ENGINE_KERNELS_ONLY and not kernels.available():
        raise QuantizationError(
            f"quantization {mode} runs on the engine's own kernels, which are off here "
            f"({kernels.unavailable_reason()}); use w4a16 or w8a8."
        )


def quantize_model(
    model: nn.Module, mode: str, int4_weights: Mapping[str, Int4Groups] | None = None
) -> None:
    """Replace `model`'s projections by `mode`'s quantized layers, in place. `int4_weights`
    (Hugging Face names, e.g. `model.layers.0.self_attn.q_proj.weight`) are the file's own
    4-bit blocks; a w4a16 or w4a8 layer without them is quantised from its float weight."""
    device = model.embed_tokens.weight.device
    check_supported(mode, device)
    int4_weights = int4_weights or {}
    for i, layer in enumerate(model.layers):
        for fused_name, parts in FUSED_PROJECTIONS.items():
            owner_name, attr = fused_name.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            if mode in INT4_MODES:
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                if all(n in int4_weights for n in names):
                    groups = Int4Groups.cat([int4_weights[n] for n in names])
                else:
                    groups = Int4Groups.quantize(linear.weight)
                new = Int4Linear(groups, device) if mode == "w4a16" else DynamicInt4Linear(groups)
            elif (
                mode == "w8a8"
                and fused_name in W8A8_KEEPS_A16
                and not _int8_kernels_take(linear.weight)
            ):
                new = Int8Linear(*int8_per_row(linear.weight))
            else:
                new = _int8_linear(mode, linear.weight)
            setattr(owner, attr, new)
    dtype = model.embed_tokens.weight.dtype
    tied = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    model.lm_head = _int8_linear(mode, model.lm_head.weight)
    if tied and isinstance(model.lm_head, Int8Linear):  # one int8 copy serves both
        q, scale = model.lm_head.weight_int8, model.lm_head.scale.float()
    else:
        q, scale = int8_per_row(model.embed_tokens.weight)
    model.embed_tokens = Int8Embedding(q, scale, dtype)


def _int8_linear(mode: str, weight: torch.Tensor) -> nn.Module:
    if mode in _INT8_ACTIVATION_HEADS:
        return DynamicInt8Linear(weight)
    return Int8Linear(*int8_per_row(weight))


# Which layer kind a module of `LlamaModel` belongs to, by its attribute name.
_KINDS = {
    "qkv_proj": "attention",
    "o_proj": "attention",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
    "embed_tokens": "embedding",
    "lm_head": "lm_head",
}
WEIGHT_KINDS = ("embedding", "attention", "mlp", "norm", "lm_head")


def weight_bytes_by_kind(model: nn.Module) -> dict[str, int]:
    """Bytes of weights held per layer kind (every kind of `WEIGHT_KINDS`, 0 if none). A
    tensor shared by two modules (a tied output projection) counts once, for the first."""
    totals = dict.fromkeys(WEIGHT_KINDS, 0)
    seen: set[int] = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        kind = _KINDS.get(leaf) or ("norm" if leaf.endswith("norm") else None)
        if kind is None:
            continue
        if isinstance(module, DynamicInt8Linear):
            totals[kind] += module.packed_nbytes
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                totals[kind] += t.untyped_storage().nbytes()
    return totals
