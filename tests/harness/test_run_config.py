"""`RunConfig` in parts: built from flat names as `bench run`'s flags give them, and
serialised into the manifest exactly as run directories always recorded it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.run.config import MANIFEST_KEYS, PART_OF, RunConfig
from harness.targets.spec import TargetSpec

# What the flat 45-field RunConfig wrote for this config (its to_dict, as json.dumps orders it).
RECORDED = (
    '{"workload": "random", "url": "http://h:1/v1", "model": "m", "endpoint": "chat", '
    '"stream": true, "chunk_usage": null, "num_requests": 5, "duration_s": null, '
    '"request_rate": "inf", "burstiness": null, "concurrency": null, "input_len": null, '
    '"output_len": null, "range_ratio": null, "ignore_eos": null, "dataset_path": null, '
    '"seed": null, "warmup": 0, "timeout_s": 600.0, "out": "runs/x", "slo": null, '
    '"tokenizer": null, "client_bound_ms": 10.0, "flush_interval_s": 5.0, '
    '"scrape_interval_s": 1.0, "server_args": ["--a"], "startup_timeout_s": 600.0, '
    '"max_error_rate": null, "max_consecutive_errors": null, "stop_on_saturation": false, '
    '"settle_s": 10.0, "faults": null, "headers": ["A"], "extra_body": {"top_k": 2}, '
    '"session_header": null, "slice_duration_s": null, "target": "ref", '
    '"engine_commands": [], "engine_pythons": [], "check_outputs": false, '
    '"diverge_before": 32, "workers": 2, "ray_address": null, "on_worker_failure": "stop", '
    '"cost_per_hour": null, "batch_size": null, "memory_budget_mb": 512.0}'
)


def test_the_manifest_config_is_what_the_flat_config_recorded():
    config = RunConfig(url="http://h:1", model="m", num_requests=5, request_rate=math.inf,
                       out=Path("runs/x"), api_key="k", headers=(("A", "b"),),
                       extra_body={"top_k": 2}, endpoint="chat", workers=2,
                       server_args=("--a",), on_worker_failure="stop")  # fmt: skip
    assert json.dumps(config.to_dict()) == RECORDED


def test_every_flat_name_but_the_api_key_is_a_manifest_key():
    assert set(MANIFEST_KEYS) == (set(PART_OF) | {"faults"}) - {"api_key"}
    assert len(MANIFEST_KEYS) == len(set(MANIFEST_KEYS)) == 47


def test_a_flat_name_replaces_one_field_of_its_part():
    base = RunConfig(url="http://h:1/v1", concurrency=4, api_key="k", out=Path("a"))
    changed = dataclasses.replace(base, request_rate=2.0, out=Path("b"))
    assert (changed.load.request_rate, changed.load.concurrency) == (2.0, 4)
    assert changed.recording.out == Path("b") and changed.server == base.server
    other = dataclasses.replace(base, target="vllm", url=None)
    assert other.server.spec == TargetSpec("vllm", None, "vllm")
    assert other.server.api_key == "k"


def test_the_url_wins_over_the_target_in_one_place():
    spec = RunConfig(url="http://h:1", target="vllm").server.spec
    assert (spec.kind, spec.url, spec.flags()) == (
        "url",
        "http://h:1/v1",
        {"url": "http://h:1/v1", "target": "vllm"},
    )
    spec = RunConfig(target="url:http://h:2").server.spec
    assert (spec.kind, spec.url, spec.flags()) == (
        "url",
        "http://h:2/v1",
        {"url": None, "target": "url:http://h:2"},
    )


def test_an_unknown_name_is_a_type_error_and_a_bad_value_one_sentence():
    with pytest.raises(TypeError, match="num_request"):
        RunConfig(num_request=5)
    with pytest.raises(HarnessError, match="--num-requests must be greater than zero"):
        RunConfig(num_requests=0)
