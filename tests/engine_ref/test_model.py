"""The paged Llama forward against a naive, independent implementation of the same model.

The reference below is written from the Llama definition (Hugging Face conventions): full
causal attention over the whole sequence, K/V heads repeated for GQA, RoPE by rotate_half,
separate q/k/v and gate/up projections. No paging, no fusion, no chunking.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_ref.core.attention import build_attention_metadata, kv_pool_shape
from engine_ref.core.config import ModelConfig
from engine_ref.core.model import LlamaModel
from engine_ref.loading.tiny_random import tiny_random_state_dict

ATOL = 1e-4  # float32 throughout; observed differences are ~1e-6

CONFIG = ModelConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
BLOCK_SIZE = 4


def naive_logits(config: ModelConfig, sd: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[S, vocab] logits of every position, computed directly."""
    h, kvh, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    seq = len(ids)

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps))

    inv = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2).double() / hd)
    ang = torch.arange(seq).double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()  # [S, hd]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()

    def rot(x):  # x [heads, S, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        y = rms(x, sd[p + "input_layernorm.weight"])
        q = (y @ sd[p + "self_attn.q_proj.weight"].T).view(seq, h, hd).transpose(0, 1)
        k = (y @ sd[p + "self_attn.k_proj.weight"].T).view(seq, kvh, hd).transpose(0, 1)
        v = (y @ sd[p + "self_attn.v_proj.weight"].T).view(seq, kvh, hd).transpose(0, 1)
        q, k = rot(q), rot(k)
        k = k.repeat_interleave(h // kvh, dim=0)
        v = v.repeat_interleave(h // kvh, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, h * hd)
        x = x + attn @ sd[p + "self_attn.o_proj.weight"].T
        y = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = y @ sd[p + "mlp.gate_proj.weight"].T
        up = y @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


@pytest.fixture(scope="module")
def weights():
    return tiny_random_state_dict(CONFIG, seed=3)


@pytest.fixture(scope="module")
def model(weights):
    return LlamaModel.from_state_dict(
        CONFIG, weights, dtype=torch.float32, device=torch.device("cpu")
    )


def new_pools(num_blocks: int = 64):
    shape = kv_pool_shape(num_blocks, BLOCK_SIZE, CONFIG.num_key_value_heads, CONFIG.head_dim)
    return [torch.zeros(shape) for _ in range(CONFIG.num_hidden_layers)]


def run_steps(model, pools, steps, dtype=torch.float32):
    """Run forwards; `steps` is a list of batches [(ids, start, block_table), ...] with
    single-token rows first. Returns the logits of every row of every step, per step."""
    out = []
    for batch in steps:
        meta = build_attention_metadata(
            start_positions=[s for _, s, _ in batch],
            num_new_tokens=[len(ids) for ids, _, _ in batch],
            block_tables=[t for _, _, t in batch],
            block_size=BLOCK_SIZE,
            num_queries_per_kv=CONFIG.num_attention_heads // CONFIG.num_key_value_heads,
            num_kv_heads=CONFIG.num_key_value_heads,
            num_pool_blocks=pools[0].shape[1],
            device=torch.device("cpu"),
            dtype=dtype,
        )
        ids = torch.tensor([t for seq_ids, _, _ in batch for t in seq_ids])
        pos = torch.tensor([s + j for seq_ids, s, _ in batch for j in range(len(seq_ids))])
        with torch.inference_mode():
            out.append(model.compute_logits(model(ids, pos, meta, pools)))
    return out


def chunked(model, ids, chunk, table):
    pools = new_pools()
    steps = [[(ids[s : s + chunk], s, table)] for s in range(0, len(ids), chunk)]
    return torch.cat(run_steps(model, pools, steps))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_prefill_matches_naive_reference(model, weights, chunk):
    ids = torch.randint(0, CONFIG.vocab_size, (53,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    table = list(range(20, 34))  # non-trivial block ids, in no special order
    table.reverse()
    expected = naive_logits(CONFIG, weights, ids)
    got = chunked(model, ids, chunk, table)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_chunks_matches_reference(model, weights):
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    tables = [[1, 7, 3], [10, 11, 12, 13, 2, 14, 15, 16], [40, 41, 42, 43, 44]]
    pools = new_pools()
    # Step 1: prefill chunks of all three. Step 2: seq0 and seq2 take one token each (decode
    # rows) while seq1 finishes its prompt. Step 3: seq2 finishes alone.
    step1 = [(seqs[0][:8], 0, tables[0]), (seqs[1][:12], 0, tables[1]), (seqs[2][:5], 0, tables[2])]
    step2 = [
        (seqs[0][8:9], 8, tables[0]),
        (seqs[2][5:6], 5, tables[2]),
        (seqs[1][12:30], 12, tables[1]),
    ]
    step3 = [(seqs[2][6:17], 6, tables[2])]
    logits1, logits2, logits3 = run_steps(model, pools, [step1, step2, step3])
    ref = [naive_logits(CONFIG, weights, s) for s in seqs]
    torch.testing.assert_close(logits1[:8], ref[0][:8], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits1[8:20], ref[1][:12], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits1[20:25], ref[2][:5], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits2[0], ref[0][8], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits2[1], ref[2][5], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits2[2:], ref[1][12:30], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits3, ref[2][6:17], atol=ATOL, rtol=0)


def test_bfloat16_close_to_float32(weights):
    ids = list(range(1, 40))
    m32 = LlamaModel.from_state_dict(
        CONFIG, weights, dtype=torch.float32, device=torch.device("cpu")
    )
    m16 = LlamaModel.from_state_dict(
        CONFIG, weights, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    table = list(range(10))
    a = chunked(m32, ids, 16, table)
    pools = [p.bfloat16() for p in new_pools()]
    b = torch.cat(run_steps(m16, pools, [[(ids, 0, table)]], dtype=torch.bfloat16))
    # bf16 has ~3 significant digits; logits here are O(10).
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_fused_weights_keep_hf_layout(model, weights):
    qkv = model.layers[1].self_attn.qkv_proj.weight
    q_rows = CONFIG.num_attention_heads * CONFIG.head_dim
    assert torch.equal(qkv[:q_rows], weights["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(
        model.layers[2].mlp.gate_up_proj.weight[CONFIG.intermediate_size :],
        weights["model.layers.2.mlp.up_proj.weight"],
    )
