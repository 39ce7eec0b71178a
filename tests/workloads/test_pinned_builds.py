"""Every built-in builds the table it built before the sources were split by kind: the table
sha256 of six requests per built-in, pinned. A change here is a change to the built requests;
if one is meant (or a new pyarrow, numpy or tokenizers changes the bytes), say so in the
commit and update the pins."""

from __future__ import annotations

import pytest

from workloads import WorkloadOptions, builtin_names, resolve_workload

PINNED = {
    "chat": "3f483cf1fd6b08d211a8c20684e30c07c095b5b03666f514826c211284ec7e97",
    "code": "5416f14442f2ca4245c6feb40d8992ae128f35d7912ccc2c05bf7a503e7a9488",
    "json": "809f5ff7be10bc525ae39e424c5ac19bffd3e7c7fb24fd73af959894a888ceeb",
    "long-context": "c9635d3aacc049584cc253980fcb658052452013c8456a41e50a6f26f131b03d",
    "mixed": "019709e0be6b4ea37f1d9f6f5f1ca1bbc5b341a6ac1eee3668361b36aa28fc95",
    "multi-turn": "8163ad3d1c16fb5149aaf7c4750dfe16c8165370bea4d667ee8e84097f62d479",
    "random": "c5fa3c93f87a25be80cc245b5a079c23dfa77bcdf4b94f4f38eade437e105a6b",
    "shared-prefix": "4270c764e8c6c526625b3c3d3675cbca57cc4a59a787e296a3fb78a391deefc1",
    "sharegpt": "71f70e2c55b9511a683e924372ce941ed9ffbf232406318b9f14bcb81991ad1d",
}


def test_every_builtin_is_pinned():
    assert sorted(PINNED) == builtin_names()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_builtin_table_sha256_is_pinned(name, bpe_tokenizer):
    built = resolve_workload(
        name, options=WorkloadOptions(num_requests=6), tokenizer=bpe_tokenizer, use_cache=False
    )
    assert built.manifest["sha256"] == PINNED[name]
