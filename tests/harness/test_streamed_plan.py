"""The load plan streams its bodies from the workload table (issue "Runs that last"): the
plan of a generating endpoint holds ids and arrivals, not a body per request, and sends
exactly the bodies the materialised plan did (the production `build_body` on the same rows)."""

from __future__ import annotations

import tracemalloc

import pytest

from engine_ref.loading import load_tokenizer
from harness.http.client import ClientOptions, RequestPayload, build_body, request_headers
from harness.load.split import split_plan
from harness.run.checks import iter_request_rows
from harness.run.config import RunConfig
from harness.run.plan import StreamedPayloads, load_plan, materialise_workload


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


def _plan(tokenizer, n: int, **kwargs):
    config = RunConfig(workload="random", num_requests=n, input_len=8, output_len=4, seed=3,
                       warmup=2, **kwargs)  # fmt: skip
    workload = materialise_workload(config, tokenizer)
    options = ClientOptions(base_url="http://127.0.0.1:9/v1", model="m")
    plan, input_tokens = load_plan(config, workload, options, tokenizer)
    return config, workload, options, plan, input_tokens


def _materialised(config, workload, options) -> list[RequestPayload]:
    return [
        RequestPayload(r["request_id"], build_body(options, r), headers=request_headers(r))
        for r in iter_request_rows(config, workload)
    ]


@pytest.mark.parametrize("kwargs", [{"request_rate": 5.0}, {"concurrency": 3}],
                         ids=["open-loop", "closed-loop"])  # fmt: skip
def test_the_streamed_plan_sends_what_the_materialised_one_did(tokenizer, kwargs):
    config, workload, options, plan, input_tokens = _plan(tokenizer, 7, **kwargs)
    assert isinstance(plan.payloads, StreamedPayloads)
    expected = _materialised(config, workload, options)
    assert list(plan.payloads) == expected
    assert list(plan.payloads) == expected  # a second pass builds the same bodies
    assert list(plan.request_ids()) == [p.request_id for p in expected]
    assert input_tokens == {r["request_id"]: r["input_tokens"] for r in workload.table.to_pylist()}
    assert [w.body for w in plan.warmup] == [p.body for p in expected[:2]]
    if "request_rate" in kwargs:
        assert list(plan.arrival_s) == workload.table.column("arrival_s").to_pylist()
    else:
        assert plan.arrival_s is None and plan.concurrency == 3


def test_indexing_a_streamed_plan_at_its_bounds(tokenizer):
    config, workload, options, plan, _ = _plan(tokenizer, 5, request_rate=5.0)
    expected = _materialised(config, workload, options)
    assert len(plan.payloads) == 5
    for i in (0, 1, 4, -1, -5):
        assert plan.payloads[i] == expected[i]
    for bad in (5, -6):
        with pytest.raises(IndexError):
            plan.payloads[bad]
    assert plan.payloads[:0] == [] and plan.payloads[3:] == expected[3:]
    assert plan.payloads[:1000] == expected and plan.payloads[1:4:2] == expected[1:4:2]


def test_a_split_streamed_plan_gives_each_request_once(tokenizer):
    config, workload, options, plan, _ = _plan(tokenizer, 9, request_rate=5.0)
    shares = split_plan(plan, 2)
    sent = [p for share in shares for p in share.payloads]
    assert sorted(p.request_id for p in sent) == sorted(plan.request_ids())
    assert {p.request_id: p.body for p in sent} == {
        p.request_id: p.body for p in _materialised(config, workload, options)
    }


def test_a_plan_holds_far_less_than_a_body_a_request(tokenizer):
    """Python memory the plan adds (tracemalloc: the workload's Arrow table is not counted,
    the plan's ids, token counts and arrivals are): the materialised plan held about 1 KB a
    request; the streamed one holds its ids and counts. Negative control: with
    `StreamedPayloads` replaced by a list of the built payloads, this fails (480 B here)."""
    n = 4000
    config = RunConfig(workload="random", num_requests=n, input_len=64, output_len=4, seed=3,
                       request_rate=100.0)  # fmt: skip
    workload = materialise_workload(config, tokenizer)
    options = ClientOptions(base_url="http://127.0.0.1:9/v1", model="m")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        plan, input_tokens = load_plan(config, workload, options, tokenizer)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(plan.payloads) == n and len(input_tokens) == n
    assert held / n < 350, f"the plan holds {held / n:.0f} bytes a request"
