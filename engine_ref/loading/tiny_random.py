"""`tiny-random`: a small Llama-architecture model with seeded random weights and a real
byte-level BPE tokenizer trained in-process, for fast tests of everything around the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine_ref.core.config import ModelConfig
from engine_ref.loading.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported where weights are made: a tokenizer needs none
    import torch

TINY_RANDOM_SEED = 0
TINY_VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2

# ChatML, as SmolLM2-Instruct's template (default system prompt included).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tokenizer. Changing it changes every tiny-random token id.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A benchmark measures how fast a serving engine
answers requests: the time to the first token, the time per output token, and the number of
tokens per second under load. The capital of France is Paris. The capital of Italy is Rome.
Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees. Numbers such as 1, 2,
3, 42, 256, 1024 and 2048 appear in logs and configuration files.
You are a helpful AI assistant. What is the capital of France? Please answer the question in
one short sentence. Hello, how are you today? I am fine, thank you for asking!
def main(): return sum(x * x for x in range(10))  # Python code with symbols {}[]()<>=+-*/
Requests arrive at random times; a scheduler batches them, a model computes logits, a sampler
picks the next token, and the detokeniser turns token ids back into text for the client.
Caches store keys and values for every layer, in blocks of sixteen tokens, shared by prefixes.
Tokenizers split text into pieces, merge frequent pairs of bytes, and map each piece to an id.
Latency, throughput, goodput, percentiles, deadlines, priorities, sessions and prompts.
Café, naïve, résumé, Zürich, São Paulo, 東京, 北京, Москва, 😀 and other non-ASCII text.
"""


def tiny_random_config(vocab_size: int = TINY_VOCAB_SIZE) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        # SmolLM2's context, so every built-in workload (long-context's 5,120-token prompts
        # included) runs on the tiny model as it does on the real one.
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
    )


def build_tiny_backend(vocab_size: int = TINY_VOCAB_SIZE) -> BackendTokenizer:
    """A GPT-2 style byte-level BPE trained on `_CORPUS`; deterministic for a given
    `tokenizers` version. Ids 0-2 are the ChatML specials, then the 256 byte symbols."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return backend


def build_tiny_tokenizer() -> Tokenizer:
    backend = build_tiny_backend()
    end_of_turn = backend.token_to_id("<|im_end|>")
    end_of_text = backend.token_to_id("<|endoftext|>")
    return Tokenizer(
        backend,
        name="tiny-random",
        chat_template=CHATML_TEMPLATE,
        eos_token_ids=(end_of_turn, end_of_text),
        bos_token_id=None,
    )


def tiny_random_state_dict(
    config: ModelConfig, *, seed: int = TINY_RANDOM_SEED, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Seeded weights with Hugging Face Llama names. Linear weights ~ N(0, 0.1^2) except the
    embedding (N(0, 1), so logits are not flat); norm weights ~ 1 + N(0, 0.1^2) so a wrong norm
    mapping changes outputs. Generated in float32, then cast, so every dtype sees the same values."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = config.head_dim
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(hidden, std=0.1)

    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0)
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(q_rows, hidden, std=0.1)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_rows, hidden, std=0.1)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_rows, hidden, std=0.1)
        sd[p + "self_attn.o_proj.weight"] = normal(hidden, q_rows, std=0.1)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=0.1)
        sd[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=0.1)
        sd[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=0.1)
        sd[p + "input_layernorm.weight"] = norm_weight()
        sd[p + "post_attention_layernorm.weight"] = norm_weight()
    sd["model.norm.weight"] = norm_weight()
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = normal(config.vocab_size, hidden, std=0.02)
    return {name: t.to(dtype) for name, t in sd.items()}
