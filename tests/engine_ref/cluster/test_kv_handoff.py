"""`engine_ref.core.kv_handoff` on tiny-random (float32): a request prefilled on engine A
(`HandoffExporter`: its first token streams with finish_reason "handoff"), exported, passed
through the KV link's framing (`kv_link.encode` / `decode`), installed on engine B and decoded
there gives the single engine's tokens and logprobs: at prompt lengths around the block size,
across block sizes and KV dtypes (lossy ones flagged, and kept out of B's prefix cache), and
for seeded sampling. Install is idempotent, free and release are; B without free blocks raises
NoFreeBlocks leaving nothing allocated; a handoff from another model is refused in one
sentence; every engine is back to idle (all blocks free) at the end of every test."""

from __future__ import annotations

import dataclasses

import pytest
from pd_util import (
    GREEDY,
    SEEDED,
    Generation,
    assert_idle,
    decode,
    make,
    prefill,
    prompt_of,
    run_single,
    run_to_end,
)

from engine_ref import SamplingParams
from engine_ref.cluster import kv_link
from engine_ref.core import kv_handoff
from engine_ref.core.kv_handoff import HandoffExporter, KVHandoffError, NoFreeBlocks

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(single, A, B): block size 16, float32 KV; each test leaves them idle."""
    return make(tiny_model), make(tiny_model), make(tiny_model)


def through_link(handoff):
    return kv_link.decode(kv_link.encode(handoff))


@pytest.mark.parametrize("length", [BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 1, 100])
def test_pd_greedy_equals_the_single_engine(engines, length):
    single, a, b = engines
    prompt = prompt_of(length)
    expected = run_single(single, prompt, GREEDY)
    exporter = HandoffExporter(a)
    generation, handoff = prefill(exporter, "r", prompt, GREEDY)
    # The first token streams from the prefill step, which ends the request on A.
    assert len(generation.tokens) == 1 and generation.finish_reasons == ["handoff"]
    assert not a.has_unfinished() and exporter.held == ["r"]
    assert handoff.num_computed_tokens == length and len(handoff.token_ids) == length + 1
    assert [b.num_tokens for b in handoff.blocks] == [
        min(BLOCK_SIZE, length - i) for i in range(0, length, BLOCK_SIZE)
    ]
    exporter.release("r")
    decode(b, through_link(handoff), GREEDY, generation)
    assert generation.tokens == expected.tokens
    assert generation.logprobs == expected.logprobs  # same layout, same dtype: bit for bit
    assert generation.finish_reasons[-1] == "length"
    assert_idle(single, a, b)


@pytest.mark.parametrize("b_block_size", [8, 32, 5])
def test_pd_across_block_sizes(tiny_model, engines, b_block_size):
    single, a, _ = engines
    b = make(tiny_model, block_size=b_block_size, num_blocks=128)
    prompt = prompt_of(37)
    expected = run_single(single, prompt, GREEDY)
    exporter = HandoffExporter(a)
    generation, handoff = prefill(exporter, "r", prompt, GREEDY)
    exporter.release("r")
    installed = kv_handoff.install(b, "r", through_link(handoff), GREEDY)
    assert installed.num_blocks == -(-37 // b_block_size) and not installed.lossy
    run_to_end(b, generation)
    assert generation.tokens == expected.tokens
    for got, want in zip(generation.logprobs, expected.logprobs, strict=True):
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert_idle(a, b)


@pytest.mark.parametrize(
    ("a_kv", "b_kv", "lossy"),
    [
        ("auto", "int8", True),  # float32 values quantised: changed
        ("auto", "fp8_e4m3", True),
        ("auto", "bf16", True),
        ("int8", "auto", False),  # int8 times its scale is exactly a float32
        ("fp8_e4m3", "auto", False),
        ("bf16", "auto", False),
    ],
)
def test_pd_across_kv_dtypes(tiny_model, a_kv, b_kv, lossy):
    a = make(tiny_model, kv_cache_dtype=a_kv)
    b = make(tiny_model, kv_cache_dtype=b_kv)
    prompt = prompt_of(40)
    expected = run_single(make(tiny_model, kv_cache_dtype=a_kv), prompt, GREEDY)
    exporter = HandoffExporter(a)
    generation, handoff = prefill(exporter, "r", prompt, GREEDY)
    exporter.release("r")
    installed = kv_handoff.install(b, "r", through_link(handoff), GREEDY)
    assert (installed.converted, installed.lossy) == (True, lossy)
    run_to_end(b, generation)
    assert len(generation.tokens) == GREEDY.max_tokens
    if not lossy:  # A's prompt KV exactly; only the new tokens' KV is stored otherwise
        assert generation.tokens == expected.tokens
        for got, want in zip(generation.logprobs, expected.logprobs, strict=True):
            # B stores the new tokens' KV in float32 where A rounds it: logprobs (down to
            # the top-5's -25) move by up to 0.3% (fp8), so 1% relative.
            assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-2)
    # Converted blocks are not B's own KV: B's prefix cache does not serve them.
    b.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0))
    (output,) = b.step()
    assert output.num_cached_tokens == 0
    assert_idle(a, b)


def test_same_kv_dtype_blocks_serve_the_prefix_cache(tiny_model, engines):
    _, a, _ = engines
    b = make(tiny_model, block_size=8, num_blocks=64)
    prompt = prompt_of(40)
    exporter = HandoffExporter(a)
    generation, handoff = prefill(exporter, "r", prompt, GREEDY)
    exporter.release("r")
    installed = kv_handoff.install(b, "r", handoff, GREEDY)
    assert (installed.converted, installed.lossy) == (False, False)
    run_to_end(b, generation)
    b.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0))
    (output,) = b.step()
    assert output.num_cached_tokens == 32  # 4 full blocks of 8 (never the last token's)
    assert_idle(a, b)


def test_seeded_sampling_continues_identically(tiny_model, engines):
    single, a, _ = engines
    b = make(tiny_model, block_size=8, num_blocks=64)
    prompt = prompt_of(20)
    expected = run_single(single, prompt, SEEDED)
    assert len(set(expected.tokens)) > 5  # the draws do depend on the logits
    exporter = HandoffExporter(a)
    generation, handoff = prefill(exporter, "r", prompt, SEEDED)
    exporter.release("r")
    assert handoff.generator_state is not None
    decode(b, through_link(handoff), SEEDED, generation)
    assert generation.tokens == expected.tokens
    assert_idle(a, b)


def test_install_twice_is_one_request_and_free_release_twice_are_no_ops(engines):
    _, a, b = engines
    exporter = HandoffExporter(a)
    _, handoff = prefill(exporter, "r", prompt_of(17), GREEDY)
    used_on_a = a.stats().num_blocks_used
    assert used_on_a == 2  # pinned after the request left A's scheduler
    first = kv_handoff.install(b, "r", handoff, GREEDY)
    table = list(b.requests["r"].sequences[0].block_table)
    second = kv_handoff.install(b, "r", handoff, GREEDY)
    assert (first.num_blocks, first.already_installed) == (2, False)
    assert (second.num_blocks, second.already_installed) == (2, True)
    assert list(b.requests) == ["r"] and b.scheduler.num_running == 1
    assert b.requests["r"].sequences[0].block_table == table
    assert b.stats().num_blocks_used == 2
    other = dataclasses.replace(handoff, token_ids=(*handoff.token_ids[:-1], 0))
    with pytest.raises(KVHandoffError, match=r"^Request id 'r' is already in use by another"):
        kv_handoff.install(b, "r", other, GREEDY)
    kv_handoff.free(b, "r")
    kv_handoff.free(b, "r")
    (aborted,) = b.step()
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert exporter.export("r").token_ids == handoff.token_ids  # held until released
    exporter.release("r")
    exporter.release("r")
    with pytest.raises(KVHandoffError, match="is not held"):
        exporter.export("r")
    assert_idle(a, b)


def test_no_free_blocks_allocates_nothing_until_blocks_free(tiny_model, engines):
    _, a, _ = engines
    b = make(tiny_model, num_blocks=4)
    exporter = HandoffExporter(a)
    _, big = prefill(exporter, "big", prompt_of(33), GREEDY)  # 3 blocks on B
    _, small = prefill(exporter, "small", prompt_of(16), GREEDY)  # 1 block on B
    kv_handoff.install(b, "small", small, GREEDY)  # 1 used, 3 free: just enough for "big"
    other = kv_handoff.install(b, "other", dataclasses.replace(small, request_id="o"), GREEDY)
    assert other.num_blocks == 1 and b.stats().num_blocks_free == 2  # one short
    with pytest.raises(NoFreeBlocks) as caught:
        kv_handoff.install(b, "big", big, GREEDY)
    assert (caught.value.needed, caught.value.free) == (3, 2)
    assert str(caught.value) == (
        "The handoff needs 3 free KV blocks and this engine has 2; retry once requests finish."
    )
    assert set(b.requests) == {"small", "other"} and b.stats().num_blocks_free == 2
    kv_handoff.free(b, "other")
    assert kv_handoff.install(b, "big", big, GREEDY).num_blocks == 3  # at the limit: fits
    kv_handoff.free(b, "small")
    kv_handoff.free(b, "big")
    b.step()
    for request_id in ("big", "small"):
        exporter.release(request_id)
    assert_idle(a, b)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"num_layers": 3},
            "The handoff's KV has 3 layers, 2 KV heads and head_dim 16, but this engine's model "
            "has 4, 2 and 16.",
        ),
        (
            {"head_dim": 32},
            "The handoff's KV has 4 layers, 2 KV heads and head_dim 32, but this engine's model "
            "has 4, 2 and 16.",
        ),
        (
            {"model_fingerprint": "engine_ref-v1|tiny-random|other-model|torch.float32"},
            "The handoff's KV was computed by 'engine_ref-v1|tiny-random|other-model|"
            "torch.float32', but this engine serves 'engine_ref-v1|tiny-random|tiny-random|"
            "torch.float32|quantization=None'; hand it to an engine of the same model and dtype.",
        ),
    ],
)
def test_an_incompatible_handoff_is_one_sentence(engines, change, message):
    _, a, b = engines
    exporter = HandoffExporter(a)
    _, handoff = prefill(exporter, "r", prompt_of(5), GREEDY)
    exporter.release("r")
    with pytest.raises(KVHandoffError) as caught:
        kv_handoff.install(b, "r", dataclasses.replace(handoff, **change), GREEDY)
    assert str(caught.value) == message
    assert_idle(a, b)


def test_weights_in_another_dtype_are_another_model(tiny_model, engines):
    _, a, _ = engines
    b = make(tiny_model, dtype="bfloat16")
    exporter = HandoffExporter(a)
    _, handoff = prefill(exporter, "r", prompt_of(5), GREEDY)
    exporter.release("r")
    with pytest.raises(KVHandoffError, match=r"^The handoff's KV was computed by .*float32"):
        kv_handoff.install(b, "r", handoff, GREEDY)
    assert_idle(a, b)


def test_what_cannot_be_handed_off(engines):
    _, a, b = engines
    exporter = HandoffExporter(a)
    with pytest.raises(KVHandoffError, match="n > 1 and beam search are not supported"):
        exporter.add_request("n2", [5, 6], SamplingParams(n=2, max_tokens=4))
    # A request that ends at its first token holds nothing: nothing to hand off.
    exporter.add_request("one", [5, 6], SamplingParams(max_tokens=1, temperature=0))
    (output,) = exporter.step()
    assert output.finished and output.outputs[0].finish_reason == "length"
    assert exporter.held == []
    with pytest.raises(KVHandoffError, match="is not held"):
        exporter.export("one")
    # Before its first token a request cannot be exported; releasing it then aborts it.
    exporter.add_request("slow", prompt_of(60), GREEDY)
    with pytest.raises(KVHandoffError, match="has not sampled its first token yet"):
        exporter.export("slow")
    exporter.release("slow")
    (aborted,) = exporter.step()
    assert aborted.outputs[0].finish_reason == "abort" and exporter.held == []
    # Nothing left to decode: B refuses rather than emitting past max_tokens.
    _, handoff = prefill(exporter, "r", prompt_of(5), GREEDY)
    exporter.release("r")
    with pytest.raises(KVHandoffError, match="nothing is left to decode"):
        kv_handoff.install(b, "r", handoff, SamplingParams(max_tokens=1, temperature=0))
    assert_idle(a, b)


def test_the_first_token_streams_before_install(engines):
    """The prefill step returns the first token (with its text) while B has not seen the
    request; B's outputs then carry on counting from it."""
    _, a, b = engines
    exporter = HandoffExporter(a)
    generation, handoff = prefill(exporter, "r", prompt_of(9), GREEDY)
    assert generation.tokens == [handoff.token_ids[-1]] and "r" not in b.requests
    exporter.release("r")
    kv_handoff.install(b, "r", handoff, GREEDY)
    (output,) = b.step()
    assert output.outputs[0].num_output_tokens == 2
    run_to_end(b, Generation())
    assert_idle(a, b)
