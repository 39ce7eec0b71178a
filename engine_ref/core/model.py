"""Llama (RMSNorm, RoPE, GQA, SwiGLU) over a flattened batch with paged KV.

`LlamaModel.forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, D]`; logits
come from `compute_logits(hidden[rows])` only for the rows that sample. Q/K/V and gate/up are
fused into single matmuls when the weights are loaded. RoPE follows Hugging Face's rotate_half
convention (the first and second halves of each head are the rotated pairs).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.core import kernels
from engine_ref.core.attention import AttentionMetadata, paged_attention
from engine_ref.core.config import ModelConfig
from engine_ref.core.kernels import bf16
from engine_ref.core.kv_dtype import QuantizedKVPool
from engine_ref.core.quant import Int4Groups, Int4Linear, quantize_model

# One layer's KV pool [2 * kvh, num_blocks, block_size, hd]: keys in heads :kvh, values after;
# a plain tensor, or int8 / fp8 values with row scales (`kv_dtype`).
KVCache = torch.Tensor | QuantizedKVPool
# The pools' storage dtypes `refkern::decode_layer` reads (int8 and fp8 with their scales).
FUSED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (it accumulates in float32 for low-precision inputs).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_tables(
    head_dim: int, max_positions: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [max_positions, head_dim] in float32, laid out for `apply_rope`: the
    angle of pair j appears at j and j + hd/2; sin is negated in the first half."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] rotated by cos, signed sin [T, heads or 1, hd] (Hugging Face's
    rotate_half pairing: x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1))."""
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)  # [T, h + 2 kvh, hd]
        # cos/sin are the identity rotation on the value heads: one RoPE call for all three.
        qkv = apply_rope(qkv, cos, sin)
        q, kv = qkv[:, : self.num_heads], qkv[:, self.num_heads :]  # [T, h, hd], [T, 2kvh, hd]
        out = paged_attention(q, kv, kv_cache, meta, self.scale)
        return self.o_proj(out.view(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack plus the (possibly tied) output projection."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        # Given an (uninitialised) weight: nn.Embedding's own random init on the meta device goes
        # through torch's reference ops, whose first use imports TorchDynamo (1.6 s of every
        # engine start); the weights are loaded right after anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        positions = max_positions or config.max_position_embeddings
        if self.embed_tokens.weight.is_meta:  # from_state_dict's skeleton: it sets the tables
            cos = sin = torch.empty(positions, config.head_dim)
        else:
            cos, sin = rope_tables(config.head_dim, positions, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.requires_grad_(False)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
        quantization: str | None = None,
        int4_weights: Mapping[str, Int4Groups] | None = None,
    ) -> LlamaModel:
        """Build from Hugging Face Llama names, fusing q/k/v and gate/up. Raises KeyError on
        a missing tensor. `quantization` (see `quant.py`) replaces the projections by low-bit
        layers, from `int4_weights` (the file's 4-bit blocks, HF names) where given; raises
        QuantizationError when the model or device cannot be quantized that way."""
        with torch.device("meta"):
            model = cls(config, max_positions)
        sd = state_dict
        fused: dict[str, torch.Tensor] = {"embed_tokens.weight": sd["model.embed_tokens.weight"]}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            fused[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
                [sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"]]
            )
            fused[f"layers.{i}.self_attn.o_proj.weight"] = sd[attn + "o_proj.weight"]
            fused[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]]
            )
            fused[f"layers.{i}.mlp.down_proj.weight"] = sd[mlp + "down_proj.weight"]
            fused[f"layers.{i}.input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
            fused[f"layers.{i}.post_attention_layernorm.weight"] = sd[
                p + "post_attention_layernorm.weight"
            ]
        fused["norm.weight"] = sd["model.norm.weight"]
        fused = {k: t.to(device=device, dtype=dtype) for k, t in fused.items()}
        if config.tie_word_embeddings:
            fused["lm_head.weight"] = fused["embed_tokens.weight"]
        else:
            fused["lm_head.weight"] = sd["lm_head.weight"].to(device=device, dtype=dtype)
        model.load_state_dict(fused, strict=True, assign=True)
        cos, sin = rope_tables(
            config.head_dim, max_positions or config.max_position_embeddings, config.rope_theta
        )
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        if quantization is not None:
            quantize_model(model, quantization, int4_weights)
        model.fused_decode = fused_layers = model._fused_decode_weights()
        if fused_layers is not None:
            kinds = {layer[i].dtype for layer in fused_layers for i in (1, 4, 8, 11)}
            if kinds == {torch.float32}:
                model.fused_max_rows = kernels.DENSE_SMALL_BATCH_ROWS
            elif kinds == {torch.bfloat16}:
                model.fused_max_rows = bf16.BF16_SMALL_BATCH_ROWS
        model.small_head = type(model.lm_head) is nn.Linear and _small_gemm_ok(model.lm_head.weight)
        return model.eval()

    def _fused_decode_weights(self) -> list[list[torch.Tensor]] | None:
        """Per layer, the weights `refkern::decode_layer` takes, when every layer can run
        it: float32 or bfloat16 on the CPU, each projection int4 in the engine kernels' layout
        or in the model's dtype (then followed by two unused tensors); norms in float32."""
        norm = self.norm.weight
        if norm.device.type != "cpu" or norm.dtype not in (torch.float32, torch.bfloat16):
            return None
        unused = torch.empty(0)
        per_layer = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            norms = tuple(n.float().contiguous() for n in norms)  # the same tensors in float32
            weights = [norms[0]]
            for i, proj in enumerate(projections):
                if isinstance(proj, Int4Linear) and proj.small:
                    weights += [proj.small_packed, proj.small_scale, proj.small_min]
                elif type(proj) is nn.Linear and _small_gemm_ok(proj.weight):
                    weights += [proj.weight, unused, unused]
                else:
                    return None
                if i == 1:
                    weights.append(norms[1])
            per_layer.append(weights)
        return per_layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """hidden [T, D] (before the final norm) for input_ids, positions [T], through the
        first `num_layers` layers (all when None; a self-speculative draft runs fewer, with
        as many KV caches)."""
        x = self.embed_tokens(input_ids)  # [T, D]
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        if self._can_fuse(x, meta, kv_caches):
            return self._fused_forward(x, positions, meta, kv_caches, len(layers))
        cos, sin = self._rope_for(positions, x.dtype)  # [T, h + 2 kvh, hd]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv_cache)
        return x

    # Set by `from_state_dict`; None where a layer cannot run `refkern::decode_layer`.
    fused_decode: list[list[torch.Tensor]] | None = None
    # The most rows a fused forward takes: more with float32 or bfloat16 projections than with
    # int4 ones.
    fused_max_rows: int = kernels.SMALL_BATCH_ROWS
    # Set by `from_state_dict`: a float32 or bfloat16 head the engine's GEMM
    # (`refkern::f32_gemm`, `refkern::bf16_gemm`) runs for small batches.
    small_head: bool = False

    def _can_fuse(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches) -> bool:
        """At most `fused_max_rows` rows, each attending to every position up to its own
        (decode rows, prefill chunks, chain drafts), or to those before its token tree and its
        ancestors in it (trees of up to TREE_BITS_MAX_NODES nodes), over pools in any
        `kv_dtype` storage (the layer stores and reads each format in place)."""
        return (
            self.fused_decode is not None
            and 0 < x.shape[0] <= self.fused_max_rows
            and (not meta.has_tree_mask or meta.tree_bits is not None)
            and x.dtype in (torch.float32, torch.bfloat16)
            and all(c.dtype in FUSED_KV_DTYPES for c in kv_caches)
        )

    def _fused_forward(self, x, positions, meta, kv_caches, num_layers) -> torch.Tensor:
        """The decoder stack as one `refkern::decode_layer` call per layer. Row r attends to
        positions 0 .. positions[r] of its sequence: its own K/V and those of the rows before
        it in the same chunk are in the pool before any row attends (the causal mask). The
        residual stream stays float32 from layer to layer and returns in x's dtype; the new
        K/V rows are stored from float32, converted or quantised to the pool's storage."""
        dtype = x.dtype
        x = x.float()
        tables = [g.block_tables for g in meta.decode_groups]
        if meta.num_prefill_tokens:  # each prefill row gets its sequence's table
            sequence = meta.prefill_out_index // meta.prefill_q_max
            tables.append(meta.prefill_block_tables.index_select(0, sequence))
        if len(tables) == 1:
            table = tables[0]
        else:
            width = max(t.shape[1] for t in tables)
            table = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
        table = table.contiguous()  # once a step, not once a layer
        if meta.tree_bits is not None:  # a tree node's position is its depth, not its slot
            lens, tree_start, tree_bits = meta.tree_context_lens, meta.tree_start, meta.tree_bits
        else:
            lens = positions + 1
            tree_start = tree_bits = torch.empty(0, dtype=torch.long)
        cos = self.rope_cos[positions].contiguous()
        sin = self.rope_sin[positions].contiguous()
        attn = self.layers[0].self_attn
        eps = self.layers[0].input_layernorm.eps
        slots = meta.slot_mapping
        for weights, kv_cache in zip(self.fused_decode[:num_layers], kv_caches, strict=True):
            values, scales = kv_cache, None
            if isinstance(kv_cache, QuantizedKVPool):
                values, scales = kv_cache.values, kv_cache.scales
            x = torch.ops.refkern.decode_layer(
                x,
                weights,
                cos,
                sin,
                values,
                slots,
                table,
                lens,
                tree_start,
                tree_bits,
                attn.num_heads,
                eps,
                attn.scale,
                scales,
            )
        return x.to(dtype)

    def _rope_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, signed sin [T, h + 2 kvh, hd]: RoPE for query and key heads, identity (1, 0)
        for value heads. Built once per step."""
        c = self.config
        tokens, rotated = positions.shape[0], c.num_attention_heads + c.num_key_value_heads
        shape = (tokens, rotated + c.num_key_value_heads, c.head_dim)
        cos = torch.ones(shape, dtype=dtype, device=positions.device)
        sin = torch.zeros(shape, dtype=dtype, device=positions.device)
        cos[:, :rotated] = self.rope_cos[positions].to(dtype).unsqueeze(1)
        sin[:, :rotated] = self.rope_sin[positions].to(dtype).unsqueeze(1)
        return cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for hidden [N, D]: float32 from the engine's head GEMM (small
        batches), else in the model's dtype."""
        normed = self.norm(hidden)
        if self.small_head:  # a plain float32 or bfloat16 nn.Linear
            weight = self.lm_head.weight
            if weight.dtype == torch.bfloat16:
                if 0 < normed.shape[0] <= bf16.BF16_SMALL_BATCH_ROWS:
                    return bf16.bf16_gemm(normed, weight)
            elif 0 < normed.shape[0] <= kernels.DENSE_SMALL_BATCH_ROWS:
                return kernels.f32_gemm(normed, weight)
        return self.lm_head(normed)


def _small_gemm_ok(weight: torch.Tensor) -> bool:
    """Whether the engine's float32 or bfloat16 GEMM can take `weight` as it is held."""
    return kernels.dense_ok(weight) or bf16.bf16_ok(weight)
