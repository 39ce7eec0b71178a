"""Pooled embeddings: the model's last hidden state for a prompt, without generating.

`embed(model, token_ids)` runs each prompt once through the decoder stack with plain causal
attention over its own tokens (`F.scaled_dot_product_attention`), holding no KV cache, then
takes the final norm's output and mean-pools it over the prompt's tokens. Each vector is
L2-normalised (unit length, so a dot product of two is their cosine, what a rerank score
and most retrieval code assume); `norm` says the length before, for callers that want it.

Why a separate forward and not a pooling request through the scheduler: a pooled prompt
needs neither KV blocks (nothing is decoded after it) nor sampling, and the paged path would
allocate, fill and free blocks only to read one hidden state; a scheduled pooling kind would
also touch the scheduler, the block manager and the output processor for a request that
never steps. This forward reads the same weights through the same modules (so quantized
projections, dtypes and devices all work) and the server runs it on the engine's own thread
between steps (`engine_ref.serving.engine_loop`), so it never races a step for the model.
Prompts run one at a time, unpadded: a batch costs the sum of its prompts, which the server
bounds (texts a request, tokens a text).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_ref.core.model import LlamaModel, apply_rope


@torch.inference_mode()
def last_hidden_state(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """hidden [T, D] after the final norm for one prompt of T >= 1 tokens (float32)."""
    c = model.config
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    tokens, heads, kv_heads = ids.shape[0], c.num_attention_heads, c.num_key_value_heads
    x = model.embed_tokens(ids)  # [T, D]
    positions = torch.arange(tokens, device=device)
    cos = model.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, hd]
    sin = model.rope_sin[positions].to(x.dtype).unsqueeze(1)
    for layer in model.layers:
        attn = layer.self_attn
        qkv = attn.qkv_proj(layer.input_layernorm(x)).view(tokens, -1, c.head_dim)
        q = apply_rope(qkv[:, :heads], cos, sin)  # [T, h, hd]
        k = apply_rope(qkv[:, heads : heads + kv_heads], cos, sin)  # [T, kvh, hd]
        v = qkv[:, heads + kv_heads :]
        group = heads // kv_heads  # GQA: each key/value head serves `group` query heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=attn.scale,
        )  # [h, T, hd]
        x = x + attn.o_proj(out.transpose(0, 1).reshape(tokens, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).float()


def embed(model: LlamaModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One unit-length float32 vector [D] per prompt: its last hidden state, mean-pooled."""
    return [F.normalize(last_hidden_state(model, ids).mean(dim=0), dim=0) for ids in prompts]
