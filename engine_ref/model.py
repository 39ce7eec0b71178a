"""Llama (RMSNorm, RoPE, GQA, SwiGLU) over a flattened batch with paged KV.

`LlamaModel.forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, D]`; logits
come from `compute_logits(hidden[rows])` only for the rows that sample. Q/K/V and gate/up are
fused into single matmuls when the weights are loaded. RoPE follows Hugging Face's rotate_half
convention (the first and second halves of each head are the rotated pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.attention import AttentionMetadata, paged_attention
from engine_ref.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_pool, v_pool: [num_blocks, block_size, kvh, hd]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Hugging Face does, then cast back before the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(
    head_dim: int, max_positions: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim / 2] in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] rotated by cos, sin [T, 1, hd / 2] (rotate_half pairing)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
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
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rope(q.view(tokens, self.num_heads, self.head_dim), cos, sin)  # [T, h, hd]
        k = apply_rope(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, kvh, hd]
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size), requires_grad=False
            )
        cos, sin = rope_tables(
            config.head_dim, max_positions or config.max_position_embeddings, config.rope_theta
        )
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
    ) -> LlamaModel:
        """Build from Hugging Face Llama names, fusing q/k/v and gate/up. Raises KeyError on
        a missing tensor."""
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
            fused["lm_head_weight"] = fused["embed_tokens.weight"]
        else:
            fused["lm_head_weight"] = sd["lm_head.weight"].to(device=device, dtype=dtype)
        model.load_state_dict(fused, strict=True, assign=True)
        cos, sin = rope_tables(
            config.head_dim, max_positions or config.max_position_embeddings, config.rope_theta
        )
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model.eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """hidden [T, D] (before the final norm) for input_ids, positions [T]."""
        x = self.embed_tokens(input_ids)  # [T, D]
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, hd / 2]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv_cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden [N, D]."""
        return F.linear(self.norm(hidden), self.lm_head_weight).float()
