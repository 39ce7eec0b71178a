"""Every built-in builds the table it built before the sources were split by kind: the table
sha256 of six requests per built-in, pinned. A change here is a change to the built requests;
if one is meant (or a new pyarrow, numpy or tokenizers changes the bytes), say so in the
commit and update the pins. (Format 3 added the tenant column and turned deadline_s into
deadline_ms: every pin changed, every other column's values unchanged, checked side by side.)"""

from __future__ import annotations

import pytest

from workloads import WorkloadOptions, builtin_names, resolve_workload

PINNED = {
    "chat": "6bd81d8f750b71e1e95ae3589c151cf513a40546f20980a95b33b28a1fe05932",
    "code": "046407ce091a01fe8cba64ff594964b5a6a378a5110b5a7a74f529e1e0a33155",
    "json": "9d5be29082bf25f5260492a48bff298ba4926008883c12f3ecef49b9ea152038",
    "long-context": "65aa0168f71c1699abc4df48ead9b16a565b09562917564a1a5766a5909c64e1",
    "mixed": "9e74471a44eef9ec9bdd8c875bba73493f9e6e0a23a62d8fce65dd13c5f99176",
    "multi-turn": "cca436739a28ebba8058a3d17eddcd4fb3806d24d1852979ec68661c8eae7875",
    "overload": "23b95755c8f502f5d786af1fa14e29e1a65ad3e8e8fae2aca057a69b725080e7",
    "random": "1bee468fd1f9592a98fda5c9f49d2c0c2f8b2fff6706d6a2d8bd7a567bfae5af",
    "shared-prefix": "68ee9eb1ae73bf3045e9eae6a227e84d80a82a52e05ac55e5cedd3ee9aa3c7dd",
    "tenants": "41304078d76434d13e5dfc4d11d1de0fdb3836a21160504550ff229e7536e1d8",
    "sharegpt": "a2356e6b67a1776927317aa9c1eb5e3e1679238f0a0440b4194331b3f50bdc66",
    "tools": "8292609dbe3e4391e248eb93ebda79ba98aee5b78e0c09207405f56709f1e3b1",
}


def test_every_builtin_is_pinned():
    assert sorted(PINNED) == builtin_names()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_builtin_table_sha256_is_pinned(name, bpe_tokenizer):
    built = resolve_workload(
        name, options=WorkloadOptions(num_requests=6), tokenizer=bpe_tokenizer, use_cache=False
    )
    assert built.manifest["sha256"] == PINNED[name]
