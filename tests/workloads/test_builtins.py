"""Every built-in resolves token-exactly; the distribution-backed ones match their sources."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import WorkloadOptions, builtin_names, resolve_workload
from workloads.lengths import length_from_spec


def _resolve(tok, name, **opts):
    return resolve_workload(name, options=WorkloadOptions(**opts), tokenizer=tok, use_cache=False)


def test_builtin_names():
    assert builtin_names() == [
        "chat",
        "code",
        "json",
        "long-context",
        "mixed",
        "multi-turn",
        "overload",
        "random",
        "shared-prefix",
        "sharegpt",
        "tenants",
        "tools",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "chat",
        "code",
        "json",
        "long-context",
        "mixed",
        "overload",
        "random",
        "shared-prefix",
        "sharegpt",
    ],
)
def test_every_builtin_is_token_exact(name, tiny_tokenizer):
    w = _resolve(tiny_tokenizer, name, num_requests=6)
    t = w.table.to_pydict()
    assert len(t["request_id"]) == 6
    for text, ids, n in zip(t["prompt"], t["prompt_token_ids"], t["input_tokens"], strict=True):
        assert tiny_tokenizer.encode(text) == ids and len(ids) == n
    assert w.manifest["synthetic"] is True
    assert all(a is not None for a in t["arrival_s"])


@pytest.mark.parametrize(
    "key, input_q, output_q",
    [
        ("azure-2023-conv", (1020, 2734, 4142), (129, 424, 601)),
        ("azure-2023-code", (1469, 5188, 7436), (13, 55, 251)),
    ],
)
def test_bundled_azure_lengths_reproduce_published_quantiles(key, input_q, output_q):
    # p50/p90/p99 as printed in the Azure trace README (recomputed from the files there)
    rng = np.random.default_rng(0)
    for which, want in (("input", input_q), ("output", output_q)):
        x = length_from_spec({"dist": "empirical", "bundled": f"{key}/{which}"}).sample(
            400_000, rng
        )
        got = np.quantile(x, [0.5, 0.9, 0.99])
        assert got == pytest.approx(want, rel=0.02, abs=1.0)


def test_sharegpt_defaults(tiny_tokenizer):
    w = _resolve(tiny_tokenizer, "sharegpt")
    t = w.table.to_pydict()
    assert len(t["request_id"]) == 64
    assert max(t["max_output_tokens"]) <= 256 and min(t["input_tokens"]) >= 4
    assert t["arrival_s"][-1] == pytest.approx(64 / 2.0)
    assert t["ignore_eos"] == [False] * 64


def test_sharegpt_fallback_distribution_matches_its_documented_medians():
    rng = np.random.default_rng(1)
    x_in = length_from_spec({"dist": "lognormal", "median": 97.8, "sigma": 1.0}).sample(
        400_000, rng
    )
    # mean of a lognormal = median * exp(sigma^2 / 2): the vLLM paper's 161.31
    assert x_in.mean() == pytest.approx(161.31, rel=0.02)


def test_mixed_interleaves_prefill_and_decode_heavy(tiny_tokenizer):
    w = _resolve(tiny_tokenizer, "mixed", num_requests=10)
    ins = w.table.column("input_tokens").to_pylist()
    outs = w.table.column("max_output_tokens").to_pylist()
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        if i % 2 == 0:
            assert 921 <= n_in <= 1127 and n_out == 8
        else:
            assert 28 <= n_in <= 36 and n_out == 192
    assert w.manifest["parameters"]["effective"]["component_counts"] == {
        "prefill_heavy": 5,
        "decode_heavy": 5,
    }


def test_long_context_bounds(tiny_tokenizer):
    ins = (
        _resolve(tiny_tokenizer, "long-context", num_requests=4)
        .table.column("input_tokens")
        .to_pylist()
    )
    assert all(3072 <= n <= 5120 for n in ins)


def test_duration_generates_arrivals_until_it_ends(tiny_tokenizer):
    w = _resolve(
        tiny_tokenizer, "random", input_len=8, output_len=4, request_rate=20.0, duration_s=5.0
    )
    times = w.table.column("arrival_s").to_pylist()
    assert max(times) <= 5.0 and 50 <= len(times) <= 150
    assert w.manifest["duration_s"] == 5.0


def test_range_ratio_on_random(tiny_tokenizer):
    w = _resolve(
        tiny_tokenizer, "random", num_requests=200, input_len=100, output_len=50, range_ratio=0.2
    )
    ins = w.table.column("input_tokens").to_pylist()
    outs = w.table.column("max_output_tokens").to_pylist()
    assert min(ins) >= 80 and max(ins) <= 120 and len(set(ins)) > 20
    assert min(outs) >= 40 and max(outs) <= 60


def test_spec_duration_without_count_runs_for_the_duration(tmp_path, tiny_tokenizer):
    path = tmp_path / "d.yaml"
    path.write_text(
        "name: d\nduration_s: 10\nsource: {kind: synthetic, input: 8, output: 4}\n"
        "arrivals: {process: constant, rate: 30}\n"
    )
    w = resolve_workload(
        str(path), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
    )
    assert w.num_requests == 300  # not the default 100
    capped = resolve_workload(
        str(path),
        options=WorkloadOptions(num_requests=20),
        tokenizer=tiny_tokenizer,
        use_cache=False,
    )
    assert capped.num_requests == 20


@pytest.mark.parametrize(
    "name", ["chat", "code", "long-context", "mixed", "shared-prefix", "sharegpt", "random"]
)
def test_builtins_fit_an_8k_context(name, tiny_tokenizer):
    # every built-in must run against SmolLM2-135M (8192-token context) without rejections
    spec_lengths = _resolve(tiny_tokenizer, name, num_requests=2).manifest["parameters"][
        "effective"
    ]
    bounds = []
    for part in spec_lengths.get("components", [spec_lengths]):
        hi = []
        for key in ("input_lengths", "output_lengths", "input", "output"):
            d = part.get(key)
            if d is not None:
                hi.append(_upper(d))
        bounds.append(sum(hi))
    prefix = spec_lengths.get("prefix", {}).get("prefix_len", 0)
    assert max(bounds) + prefix <= 8192


def _upper(d: dict) -> float:
    if d["dist"] == "fixed":
        return d["value"]
    if d["dist"] == "uniform":
        return d["high"]
    if d["dist"] == "empirical":
        return min(d["quantiles"][-1][1], d.get("max") or float("inf"))
    return d["max"]
