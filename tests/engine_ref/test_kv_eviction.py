"""Lossy KV eviction (`engine_ref.core.kv_eviction`) through `LLMEngine.step`: hand-worked
evicted counts and block traces, boundaries around the window and the sinks, attention over the
kept tokens only (against an independent float64 Llama on a one-layer model), exact prefix reuse
kept apart from lossy blocks, forks, the per-request flag and the `/metrics` counters.

Every engine here has blocks of BS = 4 tokens and a window of W = 8 tokens. At the start of a
step a sequence with C computed tokens has evicted the blocks after its S sink blocks that lie
wholly before its window: max(0, (C - W) // BS - S) blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re

import aiohttp
import pytest
import torch
from click.testing import CliRunner
from server_fixtures import running_server

from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.core.engine_config import EngineConfigError
from engine_ref.core.kernels import attention_ops
from engine_ref.loading.weights import LoadedModel
from engine_ref.serving.cli_serve import serve
from engine_ref.serving.metrics import ServerMetrics
from engine_ref.serving.server import ServerConfig

BS = 4
W = 8
SLIDING = dict(kv_eviction="sliding-window", kv_window_tokens=W)
SINKS = dict(kv_eviction="sinks", kv_window_tokens=W, kv_sink_tokens=4)  # one sink block


def make(model: LoadedModel, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                   num_threads=1, block_size=BS, max_num_batched_tokens=64)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=model)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Step to the end; per request its tokens, logprobs, last output, and the used-block gauge
    after every step (under `"__used__"`)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    result: dict = {rid: {"tokens": [], "logprobs": [], "last": None} for rid in requests}
    used = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            entry = result[out.request_id]
            entry["tokens"] += out.outputs[0].new_token_ids
            entry["logprobs"] += out.outputs[0].logprobs or []
            entry["last"] = out
        used.append(engine.block_manager.num_used_blocks)
    result["__used__"] = used
    return result


GREEDY3 = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize(
    ("eviction", "evicted", "used"),
    [
        # 20-token prompt in chunks of 4 (steps at C = 0, 4, 8, 12, 16), then decodes at
        # C = 20, 21. Sliding window: (C - 8) // 4 blocks out at C = 12, 16, 20, 21: 1, 2, 3,
        # 3 -> 12 tokens. Held after each step: ceil((C + n) / 4) - evicted blocks: 1, 2, 3,
        # then 3 (window 2 blocks + the one written) until the request ends (0).
        (SLIDING, 12, [1, 2, 3, 3, 3, 3, 0]),
        # One sink block: (C - 8) // 4 - 1 out at C = 16, 20, 21: 1, 2, 2 -> 8 tokens; one
        # more block held than without sinks once eviction starts.
        (SINKS, 8, [1, 2, 3, 4, 4, 4, 0]),
        # Off: nothing evicted, the sequence holds all of its 6 blocks (22 tokens computed
        # at the end would need 6; the last token is never computed).
        (dict(kv_eviction="none", kv_window_tokens=W), 0, [1, 2, 3, 4, 5, 6, 0]),
    ],
    ids=["sliding-window", "sinks", "none"],
)
def test_long_prompt_completes_with_bounded_blocks(tiny_model, eviction, evicted, used):
    engine = make(tiny_model, max_num_batched_tokens=4, **eviction)
    result = run(engine, {"a": (prompt_of(20), GREEDY3)})
    out = result["a"]["last"]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(result["a"]["tokens"]) == 3
    assert out.kv_evicted_tokens == evicted
    assert result["__used__"] == used
    assert engine.stats().kv_eviction.num_evicted_tokens == evicted


def test_eviction_off_is_the_exact_engine(tiny_model):
    """`none` with eviction settings given is the engine without them: same tokens, same
    logprobs, nothing evicted."""
    exact = run(make(tiny_model, max_num_batched_tokens=4), {"a": (prompt_of(20), GREEDY3)})
    off = run(
        make(tiny_model, max_num_batched_tokens=4, kv_eviction="none", kv_window_tokens=1),
        {"a": (prompt_of(20), GREEDY3)},
    )
    assert off["a"]["tokens"] == exact["a"]["tokens"]
    assert off["a"]["logprobs"] == exact["a"]["logprobs"]
    assert off["a"]["last"].kv_evicted_tokens == 0


@pytest.mark.parametrize(
    ("prompt_len", "eviction", "evicted"),
    [
        # One decode step, at C = prompt_len: (C - 8) // 4 - S blocks out.
        (7, SLIDING, 0),  # window - 1: (7 - 8) // 4 = -1
        (8, SLIDING, 0),  # window: 0
        (9, SLIDING, 0),  # window + 1: block 0 still holds position 1, in the window
        (12, SLIDING, 4),  # window + a block: block 0 (positions 0-3) is out
        (16, SLIDING, 8),
        (12, SINKS, 0),  # its one out-of-window block is the sink
        (16, SINKS, 4),  # 2 - 1 sink block
        (12, dict(SINKS, kv_sink_tokens=0), 4),  # no sink block: a sliding window
        (16, dict(SINKS, kv_sink_tokens=5), 0),  # ceil(5 / 4) = 2 sink blocks: 2 - 2
        (20, dict(SINKS, kv_sink_tokens=5), 4),  # 3 - 2
    ],
)
def test_window_and_sink_boundaries(tiny_model, prompt_len, eviction, evicted):
    engine = make(tiny_model, **eviction)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    result = run(engine, {"a": (prompt_of(prompt_len), params)})
    assert result["a"]["last"].kv_evicted_tokens == evicted
    assert len(result["a"]["tokens"]) == 2
    assert result["__used__"][-1] == 0  # everything freed at the end


# -- attention sees only the kept tokens ------------------------------------------------------


@pytest.fixture(scope="module")
def one_layer(tiny_model) -> LoadedModel:
    """tiny-random cut to its first layer. With one layer a token's K/V depend only on the
    token and its position (not on what it attended to), so KV computed before an eviction is
    exactly what an independent forward over the kept tokens alone computes."""
    config = dataclasses.replace(tiny_model.config, num_hidden_layers=1)
    weights = {
        name: t
        for name, t in tiny_model.state_dict.items()
        if not name.startswith("model.layers.") or name.startswith("model.layers.0.")
    }
    return LoadedModel(config, weights, tiny_model.tokenizer, dict(tiny_model.source))


def reference_logprobs(model: LoadedModel, tokens: list[int], positions: list[int]):
    """log-softmax of the last row of a plain float64 Llama (Hugging Face's formulas, written
    out here) over `tokens` at `positions`, causal among them."""
    c, sd = model.config, {k: v.double() for k, v in model.state_dict.items()}
    hd, h, kvh = c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    def rope(x, pos):  # x [T, heads, hd]; rotate_half pairs (i, i + hd/2)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat((-x2, x1), -1) * sin[:, None]

    x = sd["model.embed_tokens.weight"][tokens]  # [T, D]
    n = len(tokens)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = norm(x, sd[p + "input_layernorm.weight"])
        q = rope((a @ sd[p + "self_attn.q_proj.weight"].T).view(n, h, hd), positions)
        k = rope((a @ sd[p + "self_attn.k_proj.weight"].T).view(n, kvh, hd), positions)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(n, kvh, hd)
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h * hd)
        x = x + attn @ sd[p + "self_attn.o_proj.weight"].T
        m = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = m @ sd[p + "mlp.gate_proj.weight"].T, m @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    logits = norm(x[-1], sd["model.norm.weight"]) @ sd["model.embed_tokens.weight"].T
    return logits.log_softmax(-1)


# An 18-token prompt prefilled in one step, then decodes at C = 18, 19, 20 (text positions of
# the row that samples output i: 17, 18, 19, 20). Output 0 sees every position; after that the
# sliding window keeps from block (C - 8) // 4: 2, 2, 3; the sinks also keep block 0.
KEPT = {
    "sliding-window": [range(0, 18), range(8, 19), range(8, 20), range(12, 21)],
    "sinks": [
        range(0, 18),
        [*range(0, 4), *range(8, 19)],
        [*range(0, 4), *range(8, 20)],
        [*range(0, 4), *range(12, 21)],
    ],
}


@pytest.mark.parametrize("path", ["fused", "decode-kernel", "torch"])
@pytest.mark.parametrize("mode", ["sliding-window", "sinks"])
def test_attention_sees_only_kept_tokens(one_layer, monkeypatch, path, mode):
    eviction = SLIDING if mode == "sliding-window" else SINKS
    engine = make(one_layer, **eviction)
    if path != "fused":
        engine.model.fused_decode = None  # the layers run one by one
    if path == "torch":
        monkeypatch.setattr(attention_ops, "decode_kernel_ok", lambda *_: False)
    prompt = prompt_of(18, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    result = run(engine, {"a": (prompt, params)})
    tokens = prompt + result["a"]["tokens"]
    for i, kept in enumerate(KEPT[mode]):
        expected = reference_logprobs(one_layer, [tokens[p] for p in kept], list(kept))
        full = reference_logprobs(one_layer, tokens[: kept[-1] + 1], list(range(kept[-1] + 1)))
        got = result["a"]["logprobs"][i]
        for token, logprob in got.items():
            assert logprob == pytest.approx(float(expected[token]), abs=2e-4), (i, token)
        if i:  # eviction changed the answer: seeing every token would not pass the check above
            assert max(abs(lp - float(full[t])) for t, lp in got.items()) > 1e-2


def test_window_covering_the_sequence_changes_nothing_and_small_windows_are_deterministic(
    tiny_model,
):
    """On the 4-layer model: a window longer than the sequence gives the exact engine's
    logprobs; a small one gives others, the same on every run."""
    requests = {"a": (prompt_of(24, seed=5), GREEDY3)}
    exact = run(make(tiny_model), requests)
    wide = run(make(tiny_model, kv_eviction="sliding-window", kv_window_tokens=27), requests)
    assert wide["a"]["last"].kv_evicted_tokens == 0
    assert wide["a"]["logprobs"] == exact["a"]["logprobs"]
    small = [run(make(tiny_model, **SINKS), requests) for _ in range(2)]
    # Decodes at C = 24, 25; at the last (25 - 8) // 4 - 1 = 3 blocks are out.
    assert small[0]["a"]["last"].kv_evicted_tokens == 12
    assert small[0]["a"]["logprobs"] == small[1]["a"]["logprobs"]
    assert small[0]["a"]["logprobs"][1:] != exact["a"]["logprobs"][1:]


# -- exact reuse kept apart -------------------------------------------------------------------


@pytest.mark.parametrize(("eviction", "cached"), [(SLIDING, 16), ({}, 20)])
def test_prefix_cache_serves_only_blocks_computed_before_the_first_eviction(
    tiny_model, eviction, cached
):
    """A 24-token prompt in chunks of 8 (steps at C = 0, 8, 16). Blocks 0-1 and 2-3 are
    computed before any eviction; at C = 16 blocks 0-1 leave the window ((16 - 8) // 4 = 2),
    so blocks 4-5, computed after it, are never cached. The same prompt again finds blocks 0-3
    (16 tokens). Without eviction it finds 5 blocks: all but the one holding the last token."""
    engine = make(tiny_model, max_num_batched_tokens=8, **eviction)
    prompt, params = prompt_of(24, seed=7), SamplingParams(max_tokens=1, temperature=0)
    first = run(engine, {"a": (prompt, params)})
    assert first["a"]["last"].kv_evicted_tokens == (8 if eviction else 0)
    second = run(engine, {"b": (prompt, params)})
    assert second["b"]["last"].num_cached_tokens == cached


def test_a_prefix_hit_longer_than_the_window_is_evicted_like_any_block(tiny_model):
    """The second request finds 5 blocks (20 tokens) of the first's, computed without
    eviction; its first step computes prompt tokens 20-23 over all of them (6 blocks held),
    then decodes at C = 24, 25: (C - 8) // 4 = 4 blocks out, 3 held (4, 5 and 6)."""
    prompt = prompt_of(24, seed=11)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine = make(tiny_model, **SLIDING)
    engine.add_request("warm", prompt[:21], SamplingParams(max_tokens=1))  # blocks 0-4 exact
    while engine.has_unfinished():
        engine.step()
    result = run(engine, {"b": (prompt, params)})
    assert result["b"]["last"].num_cached_tokens == 20
    assert result["b"]["last"].kv_evicted_tokens == 16
    assert result["__used__"] == [6, 3, 0]


# -- forks, flags, metrics, configuration -----------------------------------------------------


def test_forked_samples_share_and_evict_their_blocks(tiny_model):
    """n = 2 greedy samples fork after the prefill and evict on their own tables: each gives
    the tokens of a lone greedy request under the same eviction."""
    prompt = prompt_of(20, seed=13)
    single = run(
        make(tiny_model, **SINKS),
        {"a": (prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))},
    )
    engine = make(tiny_model, **SINKS)
    engine.add_request(
        "n2", prompt, SamplingParams(n=2, max_tokens=5, temperature=0, ignore_eos=True)
    )
    tokens: dict[int, list[int]] = {0: [], 1: []}
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                tokens[c.index] += c.new_token_ids
            last = out
    assert tokens[0] == tokens[1] == single["a"]["tokens"]
    # Decodes at C = 20, 21, 22, 23; at the last (23 - 8) // 4 - 1 = 2 blocks are out.
    assert last.kv_evicted_tokens == single["a"]["last"].kv_evicted_tokens == 8
    assert engine.block_manager.num_used_blocks == 0


def test_preempted_sequences_evict_again_as_they_recompute(tiny_model):
    """Four 12-token prompts with 12 output tokens each on a 6-block pool preempt one another
    (by recompute); every one still ends with its last decode at C = 22: (22 - 8) // 4 - 1 = 2
    blocks evicted, and the pool ends idle."""
    engine = make(tiny_model, num_blocks=6, max_num_batched_tokens=8, **SINKS)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    result = run(engine, {str(i): (prompt_of(12, seed=i), params) for i in range(4)})
    assert engine.stats().num_preemptions > 0
    for i in range(4):
        assert len(result[str(i)]["tokens"]) == 12
        assert result[str(i)]["last"].kv_evicted_tokens == 8
    assert result["__used__"][-1] == 0


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_metrics_count_evicted_tokens_and_requests(tiny_model):
    """The long request evicts 12 tokens (as in the first test); the short one (5 tokens,
    decodes at C = 5, 6) none. Counters: 12 tokens, 1 request."""
    engine = make(tiny_model, max_num_batched_tokens=4, **SLIDING)
    metrics = ServerMetrics("m", engine.stats)
    assert _metric(metrics.render().decode(), "vllm:kv_evicted_tokens_total") == 0
    result = run(engine, {"long": (prompt_of(20), GREEDY3), "short": (prompt_of(5), GREEDY3)})
    assert result["long"]["last"].kv_evicted_tokens == 12
    assert result["short"]["last"].kv_evicted_tokens == 0
    text = metrics.render().decode()
    assert _metric(text, "vllm:kv_evicted_tokens_total") == 12
    assert _metric(text, "vllm:requests_kv_evicted_total") == 1


def test_metrics_over_http():
    """The long request of the first test, served: 12 tokens evicted, 1 request."""
    engine = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_threads=1,
                          num_blocks=64, block_size=BS, max_num_batched_tokens=4, **SLIDING)  # fmt: skip

    async def go(url: str) -> str:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": prompt_of(20), "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
            async with session.get(url + "/metrics") as response:
                return await response.text()

    with running_server(ServerConfig(engine=engine, port=0)) as url:
        text = asyncio.run(go(url))
    assert _metric(text, "vllm:kv_evicted_tokens_total") == 12
    assert _metric(text, "vllm:requests_kv_evicted_total") == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(kv_eviction="lru"),
            "Unknown kv_eviction 'lru'; use one of none, sliding-window, sinks.",
        ),
        (dict(kv_window_tokens=0), "kv_window_tokens must be an integer of at least 1, got 0."),
        (dict(kv_sink_tokens=-1), "kv_sink_tokens must be an integer of at least 0, got -1."),
        (dict(kv_window_tokens=8.5), "kv_window_tokens must be an integer of at least 1, got 8.5."),
        (
            dict(kv_eviction="sinks", speculative_config={"method": "ngram"}),
            "kv_eviction sinks cannot be combined with speculative decoding",
        ),
    ],
)
def test_bad_settings_are_one_sentence(options, message):
    with pytest.raises(EngineConfigError) as error:
        EngineConfig(**options)
    assert str(error.value).startswith(message)
    assert str(error.value).count(". ") == 0  # one sentence


def test_serve_cli_options():
    help_text = " ".join(CliRunner().invoke(serve, ["--help"]).output.split())
    for text in ("--kv-eviction", "--kv-window-tokens", "--kv-sink-tokens",
                 "EngineConfig.kv_eviction: none, sliding- window, sinks (default: none)",
                 "EngineConfig.kv_cache_dtype: auto, bf16, fp16, int8, fp8_e4m3 (default: auto)"):  # fmt: skip
        assert text in help_text
    result = CliRunner().invoke(serve, ["--model", "tiny-random", "--kv-eviction", "window"])
    assert result.exit_code == 2
    assert "Unknown kv_eviction 'window'" in result.output and "Traceback" not in result.output
