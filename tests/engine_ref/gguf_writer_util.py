"""Writing llama GGUF files the way llama.cpp's converter does, for the engine's tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine_ref.loading.weights import LoadedModel


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF half-split -> interleaved)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_llama_gguf(path: Path, model: LoadedModel, *, linear_qtype: int | None = None) -> Path:
    """Write `model` (float32 weights) as an F32 llama GGUF the way llama.cpp's converter
    would: GGUF tensor names, permuted Q/K rows, tokenizer.ggml.* metadata. `linear_qtype` (a
    `gguf.GGMLQuantizationType`, e.g. Q4_1) quantizes the decoder's projections with
    `gguf.quants`, as llama-quantize would."""
    import gguf
    import gguf.quants

    cfg, tok = model.config, model.tokenizer
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in tok.special_token_ids else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)
    for name, tensor in model.state_dict.items():
        values = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                values = llama_cpp_permute(values, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                values = llama_cpp_permute(values, cfg.num_key_value_heads)
            if linear_qtype is not None and rest.endswith("_proj.weight"):
                raw = gguf.quants.quantize(np.ascontiguousarray(values), linear_qtype)
                writer.add_tensor(gguf_name, raw, raw_dtype=linear_qtype)
                continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
