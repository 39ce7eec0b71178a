"""Memory per request (`engine_ref.core.kv_accounting`) through `LLMEngine.step`, hand-worked.

tiny-random in float32: 4 layers, 2 KV heads, head_dim 16, hidden 64, intermediate 128, 4
heads, vocab 512; block size 4. So one token's KV is 2 x 4 x 2 x 16 x 4 = 1,024 bytes and one
block 4,096. A row's modelled temporaries: (2 x 64 + (4 + 2 x 2) x 16 + 3 x 128) x 4 = 2,560
bytes; a sampled row's float32 logits 512 x 4 = 2,048; a prefill chunk of n rows over c
positions gathers 2 x 2 x c x 16 x 4 = 256 c bytes of K/V and 4 x n x c x 4 = 16 n c of scores.
"""

from __future__ import annotations

import pytest

from engine_ref import EngineConfig, LLMEngine, SamplingParams

BS = 4
TOKEN = 1024
BLOCK = 4096


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                   num_threads=1, block_size=BS)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_steps(engine: LLMEngine) -> dict[str, dict]:
    records = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            if out.finished:
                records[out.request_id] = out.kv_memory
            else:
                assert out.kv_memory is None  # only the finished output carries it
    return records


def test_one_request_with_a_partial_last_block(tiny_model):
    """Prompt 10, 3 outputs. Step 1 prefills 10 rows: 3 blocks, 2 slots unused; steps 2 and 3
    decode one row each: 11 then 12 tokens held (1 then 0 unused); the third output is sampled
    in step 3 and never written. Token-weighted (10, 1, 1): 3 blocks; unused (20 + 1 + 0) / 12
    = 1.75 slots = 1,792 bytes. Temporaries peak in step 1: 10 x 2,560 + 2,048 + 256 x 10
    + 16 x 10 x 10 = 31,808."""
    engine = make(tiny_model)
    engine.add_request("a", list(range(100, 110)), greedy(3))
    record = run_steps(engine)["a"]
    assert record == {
        "block_size": 4,
        "block_bytes": BLOCK,
        "steps": 3,
        "peak_blocks": 3,
        "kv_peak_bytes": 3 * BLOCK,
        "kv_mean_bytes": 3 * BLOCK,
        "kv_amortised_bytes": 3 * BLOCK,
        "kv_unused_bytes": 1792,
        "temp_peak_bytes": 31808,
    }
    assert engine.stats().kv_memory == {
        "block_bytes": BLOCK,
        "unused_slot_bytes": 0,  # the last step held 12 tokens in 3 blocks
        "shared_blocks": 0,
        "temp_bytes": 2560 + 2048,
    }


def test_a_prefix_shared_by_three_requests_is_amortised(tiny_model):
    """`a` (prefix P of 8 tokens + 2) prefills alone in step 1 and registers P's 2 blocks.
    Then `b` (P + 3) and `c` (P + 1) arrive: in step 2 both hit P, so P's blocks have 3
    references; `a` finishes there (2 outputs) and in step 3 P has 2.
    a: step 1 weight 10, 3 own blocks; step 2 weight 1, 2/3 + 2/3 + 1 = 5/3 blocks.
       amortised (10 x 3 + 5/3) / 11 = 2.8788 blocks = 11,792 bytes (rounded).
    b: step 2 computes 3 rows (11 held, 1 unused), 5/3 blocks; step 3 one row (12, 0), P's
       blocks at 1/2 each: 2 blocks. (3 x 5/3 + 2) / 4 = 1.75 blocks = 7,168; unused 0.75 slot.
    c: step 2 computes its last prompt token (9 held, 3 unused), 5/3; step 3 (10, 2), 2.
       (5/3 + 2) / 2 = 11/6 blocks = 7,509 bytes; unused 2.5 slots = 2,560."""
    prefix = list(range(200, 208))
    engine = make(tiny_model)
    engine.add_request("a", prefix + [300, 301], greedy(2))
    first = engine.step()
    assert [o.finished for o in first] == [False]
    engine.add_request("b", prefix + [310, 311, 312], greedy(2))
    engine.add_request("c", prefix + [320], greedy(2))
    records = run_steps(engine)
    assert {rid: r["kv_amortised_bytes"] for rid, r in records.items()} == {
        "a": 11792,
        "b": 7168,
        "c": 7509,
    }
    assert {rid: r["kv_unused_bytes"] for rid, r in records.items()} == {
        "a": round((10 * 2 + 1 * 1) / 11 * TOKEN),
        "b": 768,
        "c": 2560,
    }
    # sharing lowers the amortised share, never the blocks a request holds
    assert all(r["kv_peak_bytes"] == r["kv_mean_bytes"] == 3 * BLOCK for r in records.values())


@pytest.mark.parametrize(
    ("prompt_len", "blocks"),
    [(7, 2), (8, 3), (9, 3)],  # the first output fills slot 8: just below, at, above a block
)
def test_block_boundaries(tiny_model, prompt_len, blocks):
    """Two outputs: the prefill writes prompt_len rows (ceil(prompt_len / 4) blocks), the
    decode row one more (ceil((prompt_len + 1) / 4)); unused slots weighted prompt_len : 1."""
    engine = make(tiny_model)
    engine.add_request("r", list(range(50, 50 + prompt_len)), greedy(2))
    record = run_steps(engine)["r"]
    assert record["peak_blocks"] == blocks
    held = -(-prompt_len // BS) * BS - prompt_len, blocks * BS - prompt_len - 1
    assert record["kv_unused_bytes"] == round(
        (prompt_len * held[0] + held[1]) / (prompt_len + 1) * TOKEN
    )


def test_an_aborted_request_reports_what_it_held(tiny_model):
    engine = make(tiny_model)
    engine.add_request("x", list(range(60, 66)), greedy(50))
    engine.step()
    engine.abort("x")
    (out,) = engine.step()
    assert out.finished and out.kv_memory["peak_blocks"] == 2  # 6 prompt tokens in blocks of 4
    engine.add_request("never", list(range(60, 66)), greedy(5))
    engine.abort("never")
    (out,) = engine.step()
    assert out.kv_memory is None  # never scheduled: nothing held


def test_lossy_eviction_lowers_what_a_request_holds_and_is_flagged(tiny_model):
    """Sliding window of 8 tokens, blocks of 4, prompt 20, 4 outputs. Step 1 prefills all 20
    rows (5 blocks, none unused: a chunk is not cut at the window). Before step 2 the blocks
    wholly older than the last 8 tokens (0-11: 3 blocks) go, so steps 2-4 hold blocks 3, 4 and
    the new one: 3 blocks, holding 9, 10, 11 tokens (3, 2, 1 unused). Token-weighted over
    (20, 1, 1, 1): mean (20 x 5 + 3 x 3) / 23 blocks; unused (3 + 2 + 1) / 23 slots."""
    engine = make(tiny_model, kv_eviction="sliding-window", kv_window_tokens=8)
    engine.add_request("w", list(range(100, 120)), greedy(4))
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in engine.step() if out.finished]
    (out,) = outputs
    assert out.kv_evicted_tokens == 12
    record = out.kv_memory
    assert record["peak_blocks"] == 5 and record["steps"] == 4
    assert record["kv_mean_bytes"] == round((20 * 5 + 3 * 3) / 23 * BLOCK)
    assert record["kv_unused_bytes"] == round((3 + 2 + 1) / 23 * TOKEN)


def test_sequences_of_one_request_count_the_blocks_they_share_once(tiny_model):
    """n = 2, prompt 8 (2 full blocks), 2 outputs each. Step 1 prefills 8 rows on one sequence
    (2 blocks); the fork then shares both, and in step 2 each sequence writes its first output
    into a block of its own: 4 distinct blocks, the shared two referenced only by this request,
    so they count whole. Token-weighted (8, 1 + 1): (8 x 2 + 2 x 4) / 10 = 2.4 blocks."""
    engine = make(tiny_model)
    engine.add_request("n2", list(range(30, 38)), SamplingParams(n=2, max_tokens=2, seed=1))
    record = run_steps(engine)["n2"]
    assert record["peak_blocks"] == 4
    assert record["kv_mean_bytes"] == record["kv_amortised_bytes"] == round(2.4 * BLOCK)
