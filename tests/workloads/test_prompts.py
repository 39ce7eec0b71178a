"""Token-exact prompt synthesis: exact counts, natural text, shared prefixes, slow path."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads import WorkloadOptions, resolve_workload
from workloads.assemble import PromptCheck, plain_prompts
from workloads.prompts import PromptSynthesizer, corpus_text


@pytest.fixture(scope="module")
def tiny_synth(tiny_tokenizer):
    return PromptSynthesizer(tiny_tokenizer)


def _assert_exact(tokenizer, prompts, lengths):
    for p, n in zip(prompts, lengths, strict=True):
        ids = tokenizer.encode(p.text)
        assert len(ids) == n
        assert ids == p.token_ids.tolist()


def test_thousand_prompts_exact_tiny_random(tiny_tokenizer):
    synth = PromptSynthesizer(tiny_tokenizer)
    assert synth.fast
    lengths = np.random.default_rng(5).integers(1, 700, size=1000)
    prompts = synth.prompts(lengths, np.random.default_rng(6))
    _assert_exact(tiny_tokenizer, prompts, lengths.tolist())
    # and the other direction: decoding the ids gives the prompt text
    assert all(tiny_tokenizer.decode(p.token_ids.tolist()) == p.text for p in prompts)


@pytest.mark.parametrize("fixture", ["bpe_tokenizer", "bpe_tokenizer_nobatch"])
def test_exact_with_other_bpe_vocabularies(fixture, request):
    tok = request.getfixturevalue(fixture)
    lengths = np.random.default_rng(1).integers(1, 400, size=300)
    prompts = plain_prompts(
        PromptSynthesizer(tok), lengths, np.random.default_rng(2), PromptCheck()
    )
    _assert_exact(tok, prompts, lengths.tolist())


def test_slow_path_for_sentencepiece_style_tokenizer(metaspace_tokenizer):
    synth = PromptSynthesizer(metaspace_tokenizer)
    assert not synth.fast  # Metaspace decoding does not keep word boundaries GPT-2 style
    lengths = [1, 2, 5, 33, 120, 257]
    check = PromptCheck()
    prompts = plain_prompts(synth, np.asarray(lengths), np.random.default_rng(0), check)
    _assert_exact(metaspace_tokenizer, prompts, lengths)
    assert check.checked == len(lengths)


def test_prompts_read_as_corpus_text(tiny_tokenizer):
    synth = PromptSynthesizer(tiny_tokenizer)
    words = set(re.findall(r"[A-Za-z]+", corpus_text()))
    for p in synth.prompts([200] * 20, np.random.default_rng(3)):
        assert p.text[0].isalpha()  # starts at a word, leading space dropped
        found = re.findall(r"[A-Za-z]+", p.text)
        # every whole word (the last may be cut by the token budget) is a corpus word
        assert set(found[:-1]) <= words
        assert len(set(p.token_ids.tolist())) > 40  # not a repeated token


def test_prompts_are_seeded(tiny_tokenizer):
    synth = PromptSynthesizer(tiny_tokenizer)
    a = synth.prompts([50, 60], np.random.default_rng(9))
    b = synth.prompts([50, 60], np.random.default_rng(9))
    c = synth.prompts([50, 60], np.random.default_rng(10))
    assert [p.text for p in a] == [p.text for p in b] != [p.text for p in c]


def test_prompt_longer_than_the_stream_wraps(tiny_tokenizer):
    synth = PromptSynthesizer(tiny_tokenizer)
    n = len(synth.stream) + 1234
    _assert_exact(tiny_tokenizer, synth.prompts([n], np.random.default_rng(0)), [n])


def test_shared_prefix_members_share_prefix_ids(tiny_tokenizer):
    w = resolve_workload(
        "shared-prefix",
        options=WorkloadOptions(num_requests=24),
        tokenizer=tiny_tokenizer,
        use_cache=False,
    )
    t = w.table.to_pydict()
    by_group: dict[str, list[list[int]]] = {}
    for group, ids, text, n in zip(
        t["prefix_group"], t["prompt_token_ids"], t["prompt"], t["input_tokens"], strict=True
    ):
        assert tiny_tokenizer.encode(text) == ids and len(ids) == n
        assert 512 + 32 <= n <= 512 + 96
        by_group.setdefault(group, []).append(ids)
    assert len(by_group) == 4
    prefixes = set()
    for members in by_group.values():
        assert len(members) == 6
        assert all(m[:512] == members[0][:512] for m in members)
        assert len({tuple(m[512:]) for m in members}) == len(members)  # suffixes differ
        prefixes.add(tuple(members[0][:512]))
    assert len(prefixes) == 4


@pytest.mark.slow
def test_smollm2_exact_counts_and_prefixes(smollm2_tokenizer):
    synth = PromptSynthesizer(smollm2_tokenizer)
    assert synth.fast
    lengths = np.random.default_rng(11).integers(1, 2000, size=1000)
    prompts = plain_prompts(synth, lengths, np.random.default_rng(12), PromptCheck())
    _assert_exact(smollm2_tokenizer, prompts, lengths.tolist())
    assert all(smollm2_tokenizer.decode(p.token_ids.tolist()) == p.text for p in prompts)
    w = resolve_workload(
        "shared-prefix",
        options=WorkloadOptions(num_requests=16),
        tokenizer=smollm2_tokenizer,
        use_cache=False,
    )
    ids = w.table.column("prompt_token_ids").to_pylist()
    groups = w.table.column("prefix_group").to_pylist()
    for i in range(len(ids)):
        same = [j for j in range(len(ids)) if groups[j] == groups[i]]
        assert all(ids[j][:512] == ids[i][:512] for j in same)
        assert smollm2_tokenizer.encode(w.table.column("prompt")[i].as_py()) == ids[i]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_exact_counts(tiny_tokenizer, tiny_synth, lengths, seed):
    synth = tiny_synth
    check = PromptCheck()
    prompts = plain_prompts(synth, np.asarray(lengths), np.random.default_rng(seed), check)
    _assert_exact(tiny_tokenizer, prompts, lengths)
    assert check.repaired == 0  # the fast path needs no repair on this tokenizer
