"""The public API the harness uses: resolve_workload on `random`, options, schema, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import workloads
from workloads import REQUEST_SCHEMA, WorkloadError, WorkloadOptions, resolve_workload


def _resolve(tok, name="random", **opts):
    return resolve_workload(name, options=WorkloadOptions(**opts), tokenizer=tok, use_cache=False)


def test_random_fixed_lengths_are_token_exact(bpe_tokenizer):
    w = _resolve(bpe_tokenizer, input_len=100, output_len=17, num_requests=30)
    t = w.table
    assert t.schema.equals(REQUEST_SCHEMA)
    assert t.num_rows == 30
    assert set(t.column("input_tokens").to_pylist()) == {100}
    assert set(t.column("max_output_tokens").to_pylist()) == {17}
    for text, ids in zip(
        t.column("prompt").to_pylist(), t.column("prompt_token_ids").to_pylist(), strict=True
    ):
        assert bpe_tokenizer.encode(text) == ids
        assert len(ids) == 100
    assert len(set(t.column("request_id").to_pylist())) == 30
    assert w.closed_loop_concurrency is None
    assert w.manifest["synthetic"] is True
    assert w.manifest["tokenizer"] == bpe_tokenizer.name
    assert w.manifest["sha256"] == workloads.table_sha256(t)


def test_random_defaults_send_all_at_once(bpe_tokenizer):
    w = _resolve(bpe_tokenizer, num_requests=5, input_len=8)
    assert w.table.column("arrival_s").to_pylist() == [0.0] * 5
    w = _resolve(bpe_tokenizer, num_requests=5, input_len=8, request_rate=math.inf)
    assert w.table.column("arrival_s").to_pylist() == [0.0] * 5


def test_request_rate_sets_poisson_arrivals(bpe_tokenizer):
    w = _resolve(bpe_tokenizer, num_requests=200, input_len=4, output_len=4, request_rate=4.0)
    times = np.asarray(w.table.column("arrival_s").to_pylist())
    assert np.all(np.diff(times) >= 0)
    # vLLM normalisation: the last request arrives at n / rate
    assert times[-1] == pytest.approx(200 / 4.0)
    assert w.manifest["parameters"]["effective"]["arrivals"]["process"] == "poisson"


def test_closed_loop(bpe_tokenizer):
    w = _resolve(bpe_tokenizer, num_requests=6, input_len=4, concurrency=3)
    assert w.closed_loop_concurrency == 3
    assert w.table.column("arrival_s").null_count == 6
    with pytest.raises(WorkloadError, match="either concurrency"):
        _resolve(bpe_tokenizer, concurrency=3, request_rate=2.0)


def test_seed_determinism(bpe_tokenizer):
    a = _resolve(
        bpe_tokenizer, num_requests=20, input_len=50, range_ratio=0.5, request_rate=3.0, seed=7
    )
    b = _resolve(
        bpe_tokenizer, num_requests=20, input_len=50, range_ratio=0.5, request_rate=3.0, seed=7
    )
    c = _resolve(
        bpe_tokenizer, num_requests=20, input_len=50, range_ratio=0.5, request_rate=3.0, seed=8
    )
    assert a.table.equals(b.table) and a.manifest == b.manifest
    assert a.manifest["sha256"] != c.manifest["sha256"]


def test_unknown_name_lists_builtins(bpe_tokenizer):
    with pytest.raises(WorkloadError) as info:
        _resolve(bpe_tokenizer, name="no-such-workload")
    message = str(info.value)
    assert "no-such-workload" in message and "random" in message and "sharegpt" in message


def test_builtin_name_with_yaml_suffix(bpe_tokenizer):
    a = _resolve(bpe_tokenizer, name="random.yaml", num_requests=3, input_len=5)
    b = _resolve(bpe_tokenizer, name="random", num_requests=3, input_len=5)
    assert a.manifest["sha256"] == b.manifest["sha256"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"range_ratio": 1.0}, "range_ratio"),
        ({"request_rate": -1.0}, "request_rate"),
        ({"burstiness": 0.0}, "burstiness"),
        ({"endpoint": "grpc"}, "endpoint"),
        ({"duration_s": math.inf}, "duration_s"),
    ],
)
def test_options_are_validated(kwargs, match):
    with pytest.raises(WorkloadError, match=match):
        WorkloadOptions(**kwargs)


def test_burstiness_without_rate_is_an_error(bpe_tokenizer):
    with pytest.raises(WorkloadError, match="request rate"):
        _resolve(bpe_tokenizer, burstiness=2.0)


def test_dataset_path_rejected_for_random(bpe_tokenizer, tmp_path):
    with pytest.raises(WorkloadError, match="reads no dataset"):
        _resolve(bpe_tokenizer, dataset_path=str(tmp_path / "x.json"))
