"""Request classes in workload specs: each request's tenant, priority and deadline
(`workloads.classes`), through the spec parser and the builder a user's YAML goes through."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import WorkloadOptions
from workloads.build import build_workload
from workloads.classes import INT32_MAX, INT32_MIN, smooth_weighted_round_robin
from workloads.schema import WorkloadError
from workloads.spec import parse_spec

BASE = """
name: classes
num_requests: {n}
seed: {seed}
source: {{kind: synthetic, input: {{dist: fixed, value: 8}}, output: {{dist: fixed, value: 2}}}}
arrivals: {{process: poisson, rate: 5}}
"""


def _build(tokenizer, extra: str = "", n: int = 12, seed: int = 0):
    spec = parse_spec(BASE.format(n=n, seed=seed) + extra, "mine.yaml")
    return build_workload(spec, WorkloadOptions(), tokenizer)


def _column(workload, name):
    return workload.table.column(name).to_pylist()


def test_smooth_weighted_round_robin_hand_worked():
    # Nginx's example: weights 5, 1, 1 deal a a b a c a a
    picks = smooth_weighted_round_robin(np.array([5.0, 1.0, 1.0]), 14)
    assert picks.tolist() == [0, 0, 1, 0, 2, 0, 0] * 2
    assert smooth_weighted_round_robin(np.array([2.0, 1.0]), 3).tolist() == [0, 1, 0]
    assert smooth_weighted_round_robin(np.array([1.0]), 0).tolist() == []


def test_a_spec_without_classes_has_empty_class_columns(bpe_tokenizer):
    w = _build(bpe_tokenizer)
    for name in ("priority", "deadline_ms", "tenant"):
        assert _column(w, name) == [None] * 12


def test_tenants_by_weighted_round_robin_with_their_own_classes(bpe_tokenizer):
    w = _build(
        bpe_tokenizer,
        """
priority: 3
deadline_ms: 5000
tenants:
  assign: weighted_round_robin
  mix:
    - {name: heavy, weight: 10}
    - {name: light, weight: 1, priority: -1, deadline_ms: 250}
""",
        n=22,
    )
    tenants = _column(w, "tenant")
    # every window of 11 requests holds exactly one of light's
    assert [tenants[i : i + 11].count("light") for i in (0, 11)] == [1, 1]
    assert tenants.count("heavy") == 20
    for tenant, priority, deadline in zip(
        tenants, _column(w, "priority"), _column(w, "deadline_ms"), strict=True
    ):
        assert (priority, deadline) == ((-1, 250) if tenant == "light" else (3, 5000))


def test_classes_leave_every_other_column_as_it_was(bpe_tokenizer):
    plain = _build(bpe_tokenizer, n=30).table
    classed = _build(
        bpe_tokenizer,
        """
priority: {values: [0, 1, 2]}
deadline_ms: {dist: uniform, low: 100, high: 900}
tenants: {mix: [{name: a, weight: 3}, {name: b}]}
""",
        n=30,
    ).table
    keep = [c for c in plain.column_names if c not in ("priority", "deadline_ms", "tenant")]
    assert classed.select(keep).equals(plain.select(keep))
    assert set(classed.column("tenant").to_pylist()) == {"a", "b"}


def test_random_draws_follow_the_seed_and_the_weights(bpe_tokenizer):
    extra = """
priority: {values: [0, 7], weights: [1, 3]}
tenants: {mix: [{name: a, weight: 9}, {name: b}]}
"""
    first = _build(bpe_tokenizer, extra, n=400, seed=4)
    again = _build(bpe_tokenizer, extra, n=400, seed=4)
    other = _build(bpe_tokenizer, extra, n=400, seed=5)
    assert _column(first, "tenant") == _column(again, "tenant")
    assert _column(first, "tenant") != _column(other, "tenant")
    tenants = _column(first, "tenant")
    priorities = _column(first, "priority")
    # 400 draws: a's share 0.9 and priority 7's 0.75, each within 5 standard deviations
    assert abs(tenants.count("a") / 400 - 0.9) < 5 * (0.9 * 0.1 / 400) ** 0.5
    assert abs(priorities.count(7) / 400 - 0.75) < 5 * (0.75 * 0.25 / 400) ** 0.5
    assert set(priorities) == {0, 7}


def test_uniform_deadlines_reach_both_ends(bpe_tokenizer):
    w = _build(bpe_tokenizer, "deadline_ms: {dist: uniform, low: 1, high: 2}\n", n=200)
    assert set(_column(w, "deadline_ms")) == {1, 2}
    assert _column(w, "priority") == [None] * 200  # only what the spec sets


def test_a_tenant_without_a_deadline_where_the_workload_has_none(bpe_tokenizer):
    w = _build(
        bpe_tokenizer,
        """
tenants:
  assign: weighted_round_robin
  mix: [{name: a, deadline_ms: 40}, {name: b}]
""",
        n=4,
    )
    assert _column(w, "tenant") == ["a", "b", "a", "b"]
    assert _column(w, "deadline_ms") == [40, None, 40, None]
    assert _column(w, "priority") == [None] * 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("priority", INT32_MIN), ("priority", INT32_MAX), ("priority", 0), ("deadline_ms", 1),
     ("deadline_ms", INT32_MAX)],
)  # fmt: skip
def test_the_extremes_each_column_holds(bpe_tokenizer, field, value):
    w = _build(bpe_tokenizer, f"{field}: {value}\n", n=2)
    assert _column(w, field) == [value, value]


def test_every_turn_of_a_session_has_its_first_turns_classes(bpe_tokenizer):
    spec = parse_spec(
        """
name: chat-classes
num_requests: 6
source: {kind: sessions, turns: {dist: fixed, value: 3}, input: {dist: fixed, value: 8},
         output: {dist: fixed, value: 2}, think_ms: 0}
arrivals: {process: poisson, rate: 5}
deadline_ms: {dist: uniform, low: 10, high: 100000}
tenants: {mix: [{name: a}, {name: b}, {name: c}]}
""",
        "chat.yaml",
    )
    t = build_workload(spec, WorkloadOptions(), bpe_tokenizer).table
    by_session: dict = {}
    for sid, tenant, deadline in zip(
        *(t.column(c).to_pylist() for c in ("session_id", "tenant", "deadline_ms")), strict=True
    ):
        by_session.setdefault(sid, set()).add((tenant, deadline))
    assert len(by_session) == 6 and all(len(v) == 1 for v in by_session.values())


BAD = [
    ("priority: 2147483648\n", "priority: got 2147483648"),
    ("priority: -2147483649\n", "priority: got -2147483649"),
    ("priority: 1.5\n", "priority: got 1.5"),
    ("deadline_ms: 0\n", "deadline_ms: got 0"),
    ("deadline_ms: 2147483648\n", "deadline_ms: got 2147483648"),
    ("deadline_ms: {dist: uniform, low: 9, high: 3}\n", "deadline_ms.high: got 3 below low 9"),
    ("deadline_ms: {dist: normal, low: 1, high: 3}\n", "deadline_ms.dist"),
    ("priority: {dist: uniform, low: 1, high: 3}\n", "priority.dist: priorities take no dist"),
    ("priority: {values: []}\n", "priority.values: got an empty list"),
    ("priority: {values: [1, 2], weights: [1]}\n", "priority.weights: got 1 weights for 2 values"),
    ("priority: {values: [1, 2], weights: [1, 0]}\n", "priority.weights[1]: got 0"),
    ("tenants: {mix: []}\n", "tenants.mix: got an empty list"),
    ("tenants: {assign: fair, mix: [{name: a}]}\n", "tenants.assign"),
    ("tenants: {mix: [{name: a}, {name: a}]}\n", "tenants.mix[1].name: tenant 'a' appears twice"),
    ("tenants: {mix: [{name: ''}]}\n", "tenants.mix[0].name"),
    ("tenants: {mix: [{name: a, weight: 0}]}\n", "tenants.mix[0].weight: got 0"),
    ("tenants: {mix: [{name: a, share: 2}]}\n", "tenants.mix[0]"),
    ("tenants: {mix: [{weight: 2}]}\n", "tenants.mix[0]"),
    ("tenants: [{name: a}]\n", "tenants: "),
    (f"tenants: {{mix: [{{name: {'x' * 257}}}]}}\n", "got 257 characters"),
]


@pytest.mark.parametrize(("extra", "fragment"), BAD, ids=[b[1][:40] for b in BAD])
def test_a_bad_class_is_one_sentence_with_its_place(extra, fragment):
    with pytest.raises(WorkloadError) as info:
        parse_spec(BASE.format(n=2, seed=0) + extra, "mine.yaml")
    message = str(info.value)
    assert message.startswith("mine.yaml:7: ") and fragment in message, message
    assert "\n" not in message and "Traceback" not in message


def test_a_name_at_the_length_limit_is_taken(bpe_tokenizer):
    w = _build(bpe_tokenizer, f"tenants: {{mix: [{{name: {'x' * 256}}}]}}\n", n=1)
    assert _column(w, "tenant") == ["x" * 256]


def test_a_classed_workload_survives_its_parquet_file(bpe_tokenizer, tmp_path):
    """Half the deadlines null: the parquet reader fills an int column's null slots with its
    dictionary's first value, which the digest must not see."""
    from workloads import read_parquet
    from workloads.build import build_workload_file

    spec = parse_spec(
        BASE.format(n=10, seed=0)
        + "tenants: {assign: weighted_round_robin, mix: [{name: a, deadline_ms: 1500}, {name: b}]}\n",
        "mine.yaml",
    )
    path = tmp_path / "w.parquet"
    manifest = build_workload_file(spec, WorkloadOptions(), bpe_tokenizer, path)
    read = read_parquet(path)
    assert read.manifest["sha256"] == manifest["sha256"]
    assert read.table.column("deadline_ms").to_pylist() == [1500, None] * 5
