"""Load a Llama-architecture GGUF file: config from `llama.*` keys, dequantised weights under
Hugging Face names with Q/K rows back in Hugging Face order, and the byte-level BPE tokenizer
rebuilt from `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine_ref.core.config import ModelConfig
from engine_ref.loading.gguf_file import read_gguf, tensor_bytes
from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.tokenizer import Tokenizer, eos_ids_for

if TYPE_CHECKING:  # only weights need torch; a tokenizer loads without it
    import torch

    from engine_ref.core.quant import Int4Groups

# GGUF tensor names -> Hugging Face Llama names (per-layer names use {i}).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GPT-2's split pattern is what tokenizers' ByteLevel(use_regex=True) applies; these
# `tokenizer.ggml.pre` values use it, some after splitting digits one by one.
_PRE_GPT2 = frozenset({"default", "gpt2"})
_PRE_GPT2_DIGITS = frozenset({"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"})
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_LLAMA3 = frozenset({"llama-bpe", "llama3", "smaug-bpe"})


def hf_from_gguf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when the engine has no use for it."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_qk(weight: np.ndarray | torch.Tensor, num_heads: int) -> Any:
    """Undo llama.cpp's convert-time permutation of a Q or K projection ([num_heads*head_dim, in]).

    GGUF stores each head's rows interleaved for adjacent-pair RoPE (rows x0, y0, x1, y1, ...);
    Hugging Face's rotate_half wants the halves (x0, x1, ..., y0, y1, ...)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ModelFileError(f"Cannot split {rows} Q/K rows into {num_heads} heads of even size.")
    rest = tuple(weight.shape[1:])
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def config_from_metadata(meta: Mapping[str, Any], *, tied: bool) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelFileError(f"GGUF architecture {arch!r} is not supported; only 'llama' is.")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ModelFileError(f"GGUF file lacks the metadata key 'llama.{name}'.")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    config = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        rope_theta=_shortest(key("rope.freq_base", 10000.0)),
        rms_norm_eps=_shortest(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings=tied,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    rope_dims = meta.get("llama.rope.dimension_count", config.head_dim)
    if rope_dims != config.head_dim:
        raise ModelFileError(
            f"Partial rotary embeddings ({rope_dims} of {config.head_dim} dims) are not supported."
        )
    if meta.get("llama.rope.scaling.type") not in (None, "none"):
        raise ModelFileError(f"RoPE scaling {meta['llama.rope.scaling.type']!r} is not supported.")
    return config


def _shortest(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747e-06; keep the intended decimal."""
    return float(str(np.float32(value)))


def tokenizer_from_metadata(meta: Mapping[str, Any], *, name: str) -> Tokenizer:
    """Rebuild the byte-level BPE tokenizer that llama.cpp's converter stored in the file."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFileError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is."
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or ()]
    if any(len(m) != 2 for m in merges):
        raise ModelFileError("GGUF tokenizer merges are malformed (each must be two tokens).")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(token_types)
            if t == _TOKEN_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(token_types)
            if t == _TOKEN_USER_DEFINED
        ]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        special = [(tokens[bos_id], bos_id)] if add_bos else []
        if add_eos and (not add_bos or eos_id != bos_id):
            special.append((tokens[eos_id], eos_id))
        bos = f"{tokens[bos_id]} " if add_bos else ""
        eos = f" {tokens[eos_id]}" if add_eos else ""
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} $B{eos}", special_tokens=special
        )
    return Tokenizer(
        backend,
        name=name,
        chat_template=meta.get("tokenizer.chat_template") or "",
        eos_token_ids=eos_ids_for(backend, [eos_id]),
        bos_token_id=bos_id,
    )


def _pre_tokenizer(pre: str) -> Any:
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_GPT2_DIGITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _PRE_LLAMA3:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelFileError(f"GGUF pre-tokenizer {pre!r} is not supported.")


def load_gguf_tokenizer(path: Path, *, name: str) -> Tokenizer:
    """The tokenizer of a GGUF file, without reading any weight."""
    return tokenizer_from_metadata(read_gguf(path, with_tensors=False).metadata, name=name)


def load_gguf(
    path: Path, *, dtype: torch.dtype, name: str, int4_weights: dict[str, Int4Groups] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, dequantised state dict (HF names, HF Q/K order, `dtype`) and tokenizer. When
    `int4_weights` is a dict, the Q4_0/Q4_1 matrices are also put there as stored (HF names,
    Q/K rows in HF order)."""
    from engine_ref.loading.dequant import dequantize_to_torch, int4_groups

    contents = read_gguf(path)
    meta = contents.metadata
    tensor_names = {t.name for t in contents.tensors}
    config = config_from_metadata(meta, tied="output.weight" not in tensor_names)
    state_dict: dict[str, torch.Tensor] = {}
    with _torch_threads(1):
        for info in contents.tensors:
            hf_name = hf_from_gguf_name(info.name)
            if hf_name is None:
                raise ModelFileError(f"GGUF tensor {info.name!r} is not supported by this engine.")
            raw = tensor_bytes(path, info)
            values = dequantize_to_torch(raw, info.ggml_type, info.shape)
            groups = None if int4_weights is None else int4_groups(raw, info.ggml_type, info.shape)
            heads = None
            if hf_name.endswith("q_proj.weight"):
                heads = config.num_attention_heads
            elif hf_name.endswith("k_proj.weight"):
                heads = config.num_key_value_heads
            if heads is not None:
                values = unpermute_qk(values, heads)
                if groups is not None:
                    groups = groups.map_rows(lambda t, h=heads: unpermute_qk(t, h).contiguous())
            state_dict[hf_name] = values.to(dtype).contiguous()
            if groups is not None:
                int4_weights[hf_name] = groups
    _check_shapes(config, state_dict)
    return config, state_dict, tokenizer_from_metadata(meta, name=name)


@contextlib.contextmanager
def _torch_threads(num_threads: int) -> Iterator[None]:
    """Run a block with `num_threads` intra-op threads, then restore. Dequantising is a chain of
    small memory-bound ops: one thread is as fast on an idle machine and far faster on a busy
    one (measured 1.2 s vs 14 s for SmolLM2 with 2 threads on 2 oversubscribed cores)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _check_shapes(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> None:
    hidden, head_dim = config.hidden_size, config.head_dim
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.layers.0.self_attn.q_proj.weight": (config.num_attention_heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (config.num_key_value_heads * head_dim, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, config.intermediate_size),
    }
    for name, shape in expected.items():
        if name in state_dict and tuple(state_dict[name].shape) != shape:
            raise ModelFileError(
                f"Tensor {name!r} has shape {tuple(state_dict[name].shape)}, but the metadata implies {shape}."
            )
