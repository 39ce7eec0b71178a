"""SLO spec loading, built-in names and schema errors."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from slo import PerRequestObjectives, SLOError, SLOSpec, builtin_names, load_slo


def test_builtins_by_name_and_file_name():
    assert builtin_names() == ["interactive", "p99"]
    assert load_slo("p99") == load_slo("p99.yaml")
    p99 = load_slo("p99")
    assert p99.per_request.ttft_ms == 2000 and p99.per_request.tpot_ms == 200
    assert [(p.metric, p.percentile, p.max_ms) for p in p99.percentiles] == [
        ("ttft_ms", 99, 2000), ("tpot_ms", 99, 200)
    ]  # fmt: skip
    assert p99.attainment_min == 0.99 and p99.error_rate_max == 0.01
    interactive = load_slo("interactive")
    assert (interactive.per_request.ttft_ms, interactive.per_request.tpot_ms) == (450, 40)


def test_unknown_name_lists_builtins():
    with pytest.raises(SLOError, match="built-ins: interactive, p99"):
        load_slo("p42")
    with pytest.raises(SLOError, match="built-ins"):
        load_slo("somewhere/p99.yaml")


def test_path_wins_over_builtin(tmp_path, monkeypatch):
    (tmp_path / "p99.yaml").write_text("name: mine\nper_request: {ttft_ms: 5}\n")
    monkeypatch.chdir(tmp_path)
    assert load_slo("p99.yaml").name == "mine"
    assert load_slo("p99").name == "p99"  # no file called "p99": the built-in


def test_roundtrip_and_frozen():
    spec = load_slo("p99")
    assert SLOSpec.from_dict(spec.to_dict()) == spec
    assert SLOSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "x"


def test_slice_overrides_parse(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\nper_request: {ttft_ms: 100, tpot_ms: 10}\n"
        "slices:\n  - name: long\n    input_tokens: [1000, null]\n    per_request: {ttft_ms: 400}\n"
    )
    spec = load_slo(path)
    (override,) = spec.slices
    assert override.input_tokens == (1000.0, None)
    merged = spec.per_request.merged(override.per_request)
    assert (merged.ttft_ms, merged.tpot_ms) == (400, 10)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("per_request: {ttft_ms: 1}", r"bad\.yaml:1: missing key 'name'; required keys: name\."),
        (
            "name: x\nttft_ms: 1",
            r"bad\.yaml:2: unknown key 'ttft_ms' \(did you mean 'ttft'\?\); known keys: name, ",
        ),
        (
            "name: x\nper_request: {ttft: 1}",
            r"bad\.yaml:2: per_request: unknown key 'ttft' \(did you mean 'ttft_ms'\?\)",
        ),
        (
            "name: x\nper_request: {ttft_ms: -5}",
            r":2: per_request\.ttft_ms: got -5; expected a number of milliseconds > 0",
        ),
        (
            "name: x\nattainment_min: 99",
            r":2: attainment_min: got 99; expected a fraction in \(0, 1\] \(write 0.99 for 99%\)",
        ),
        (
            "name: x\nerror_rate_max: 1.5",
            r"error_rate_max: got 1\.5; expected a fraction in \[0, 1\]",
        ),
        (
            "name: x\npercentiles: [{metric: ttfb_ms, percentile: 99, max_ms: 1}]",
            r"percentiles\[0\]\.metric: got 'ttfb_ms' \(did you mean 'ttft_ms'\?\); expected one of "
            r"ttft_ms, tpot_ms",
        ),
        (
            "name: x\npercentiles: [{metric: ttft_ms, percentile: 100, max_ms: 1}]",
            r"percentiles\[0\]\.percentile: got 100; expected a percentile in \(0, 100\)",
        ),
        (
            "name: x\npercentiles: [{metric: ttft_ms, max_ms: 1}]",
            r"percentiles\[0\]: missing key 'percentile'",
        ),
        ("name: x\nmin_samples: -1", r":2: min_samples: got -1; expected an integer >= 0"),
        ("name: x\nconfidence: 95", r"confidence: got 95; expected a fraction in \[0.5, 1\)"),
        (
            "name: x\nslices: [{name: a, input_tokens: [5, 1]}]",
            r"slices\[0\]\.input_tokens: low 5 is not below high 1; expected low < high",
        ),
        ("name: x\nper_request: [1, 2]", r":2: per_request: got a list; expected a mapping"),
        ("name: [unclosed", r"bad\.yaml:1: not valid YAML \(.*\); fix its syntax"),
        ("- just a list", r"bad\.yaml:1: got a list; expected a mapping"),
        ("name: x\nname: y", r"bad\.yaml:2: duplicate key 'name' \(first on line 1\)"),
        ("", r"bad\.yaml: the document is empty; expected a mapping"),
    ],
)
def test_schema_errors_are_one_sentence(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SLOError, match=message) as info:
        load_slo(path)
    text_out = str(info.value)
    assert text_out.endswith(".") and "\n" not in text_out
    assert str(path) in text_out


def test_direct_construction_is_validated():
    with pytest.raises(SLOError, match="PerRequestObjectives"):
        SLOSpec(name="x", per_request={"ttft_ms": 1})
    with pytest.raises(SLOError, match="^ttft_ms: got 0; expected a number of milliseconds > 0"):
        PerRequestObjectives(ttft_ms=0)
    with pytest.raises(SLOError, match="^name: got ''; expected non-empty text"):
        SLOSpec(name="")
