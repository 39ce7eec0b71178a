"""Workload sources: the registry, one typed spec per kind with the same interface, and spec
mistakes named with their key and line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import workloads
from workloads.schema import WorkloadError
from workloads.sources import (
    SOURCES,
    MixSource,
    SessionsSource,
    ShareGPTSource,
    SyntheticSource,
    ToolsSource,
    TraceSource,
    source_from_dict,
)
from workloads.spec import parse_spec


def test_registry_maps_every_kind_to_its_class():
    assert SOURCES == {
        "synthetic": SyntheticSource,
        "mix": MixSource,
        "sharegpt": ShareGPTSource,
        "trace": TraceSource,
        "sessions": SessionsSource,
        "tools": ToolsSource,
    }


@pytest.mark.parametrize("kind", SOURCES)
def test_every_source_has_the_same_interface(kind):
    cls = SOURCES[kind]
    assert cls.kind == kind and cls.__module__ == f"workloads.sources.{kind}"
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    for name in ("from_dict", "rows", "takes_prefix", "reads_dataset", "default_num_requests"):
        assert hasattr(cls, name), name


@pytest.mark.parametrize(
    ("data", "kind", "fields"),
    [
        ({"kind": "synthetic", "input": 8, "output": 4}, SyntheticSource, {"input": 8}),
        (
            {"kind": "mix", "components": [{"input": 8, "output": 4, "weight": 2}]},
            MixSource,
            {"interleave": "alternate"},
        ),
        ({"kind": "sharegpt", "path": None, "shuffle": False}, ShareGPTSource, {"path": None}),
        ({"kind": "trace", "format": "mooncake"}, TraceSource, {"sample": "sequential"}),
        ({"kind": "sessions", "path": "c.json", "max_turns": 3}, SessionsSource, {"think_ms": 0}),
    ],
)
def test_from_dict_reads_each_kind(data, kind, fields):
    source = source_from_dict(data, "source")
    assert type(source) is kind
    for name, value in fields.items():
        assert getattr(source, name) == value
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.kind = "x"


def test_direct_construction_is_checked():
    with pytest.raises(WorkloadError, match=r"^input: got 0; expected a token count >= 1"):
        SyntheticSource(input=0, output=4)
    with pytest.raises(WorkloadError, match=r"^format: got 'csv'; expected one of azure"):
        TraceSource(format="csv")
    assert not TraceSource(format="mooncake").takes_prefix
    assert TraceSource(format="azure").takes_prefix


SPEC = "name: x\nnum_requests: 4\nsource:\n"
# (the source mapping, from line 4 on; the message)
MISTAKES = [
    ("  kind: synthetic\n  input: 8\n", r"x\.yaml:3: source: missing key 'output'; required keys"),
    (
        "  kind: synthetic\n  input: 8\n  output: 4\n  ouput: 5\n",
        r"x\.yaml:7: source: unknown key 'ouput' \(did you mean 'output'\?\); known keys: kind, ",
    ),
    ("  kind: synthetic\n  input: -3\n  output: 4\n", r"x\.yaml:5: source\.input: got -3; "),
    ("  kind: synthetic\n  input: true\n  output: 4\n", r"x\.yaml:5: source\.input: got true; "),
    (
        "  kind: synthetc\n",
        r"x\.yaml:4: source\.kind: got 'synthetc' \(did you mean 'synthetic'\?\)",
    ),
    ("  input: 8\n", r"x\.yaml:3: source: missing key 'kind'; expected one of synthetic, mix, "),
    ("  kind: mix\n  components: []\n", r"x\.yaml:5: source\.components: no components; "),
    (
        "  kind: mix\n  components:\n    - {input: 8, output: 4}\n    - {input: 8, output: 4, "
        "weight: 0}\n",
        r"x\.yaml:7: source\.components\[1\]\.weight: got 0; expected a number > 0\.",
    ),
    (
        "  kind: mix\n  interleave: shuffled\n  components: [{input: 8, output: 4}]\n",
        r"x\.yaml:5: source\.interleave: got 'shuffled'; expected one of alternate, random\.",
    ),
    (
        "  kind: sharegpt\n  fallback: {input: 8}\n",
        r"x\.yaml:5: source\.fallback: missing key 'output'",
    ),
    (
        "  kind: sharegpt\n  min_prompt_tokens: 0\n",
        r"x\.yaml:5: source\.min_prompt_tokens: got 0; expected an integer >= 1\.",
    ),
    ("  kind: sharegpt\n  shuffle: 1\n", r"x\.yaml:5: source\.shuffle: got 1; expected true or"),
    ("  kind: trace\n", r"x\.yaml:3: source: missing key 'format'"),
    (
        "  kind: trace\n  format: mooncake\n  sample: random\n",
        r"x\.yaml:6: source\.sample: got 'random'; expected one of sequential, bootstrap\.",
    ),
    (
        "  kind: sessions\n  turns: 2\n  input: 8\n  output: 4\n  think_ms: -1\n",
        r"x\.yaml:8: source\.think_ms: got -1; expected a token count >= 0",
    ),
]


@pytest.mark.parametrize(("source", "message"), MISTAKES)
def test_source_mistakes_name_the_key_and_line(source, message):
    with pytest.raises(WorkloadError, match=message) as info:
        parse_spec(SPEC + source, "x.yaml")
    assert str(info.value).endswith(".") and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed: -1\n", r"x\.yaml:4: seed: got -1; expected an integer >= 0\."),
        ("endpoint: grpc\n", r"x\.yaml:4: endpoint: got 'grpc'; expected one of completions, chat"),
        ("ignore_eos: 1\n", r"x\.yaml:4: ignore_eos: got 1; expected true or false\."),
        ("temperature: -0.1\n", r"x\.yaml:4: temperature: got -0\.1; expected a number >= 0\."),
        ("duration_s: 0\n", r"x\.yaml:4: duration_s: got 0; expected a number > 0\."),
        ("arrivals: {rate: 2}\n", r"x\.yaml:4: arrivals: missing key 'process'; expected one of "),
        ("arrivals: {process: sometimes}\n", r"x\.yaml:4: arrivals\.process: got 'sometimes'"),
        ("prefix: {groups: 0, prefix_len: 8}\n", r"x\.yaml:4: prefix\.groups: got 0; expected an "),
        ("prefix: {groups: 2}\n", r"x\.yaml:4: prefix: missing key 'prefix_len'"),
        ("prefix:\n  groups: 2\n  prefix_len: 8\n  assign: rr\n", r"x\.yaml:7: prefix\.assign: "),
        ("constraint: {regex: ''}\n", r"x\.yaml:4: constraint regex must be a non-empty string\."),
    ],
)
def test_top_level_mistakes_name_the_key_and_line(text, message):
    good = "name: x\nsource: {kind: synthetic, input: 8, output: 4}\nnum_requests: 4\n"
    with pytest.raises(WorkloadError, match=message):
        parse_spec(good + text, "x.yaml")


def test_no_workloads_module_is_over_500_lines():
    root = Path(workloads.__file__).parent
    sizes = {p.relative_to(root): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert max(sizes.values()) <= 500, sizes
