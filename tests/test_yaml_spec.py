"""`bench_common.yaml_spec`: the checks at their boundaries, the parser's lines and duplicate
keys, relocation, and the one message form that all four spec validators share."""

from __future__ import annotations

import ast
import enum
import math
import re
from pathlib import Path

import pytest
import yaml

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import SpecError, Where
from faults.plan import load_plan
from faults.plan_checks import FaultPlanError
from reports.errors import ReportError
from reports.gate_config import load_gate_config
from slo import SLOError, load_slo
from workloads.schema import WorkloadError
from workloads.spec import load_spec_file

HERE = Where("s.yaml", ("a", "b"), {(): 1, ("a",): 2, ("a", "b"): 3})


class Colour(enum.StrEnum):
    RED = "red"
    GREEN = "green"


# (check, value, keyword arguments, the message, or None when the value passes)
CHECKS = [
    (ys.number, 0, {"minimum": 1}, "got 0; expected a number >= 1"),
    (ys.number, 1, {"minimum": 1}, None),
    (ys.number, 2, {"minimum": 1}, None),
    (ys.number, 1, {"maximum": 1}, None),
    (ys.number, 1.0001, {"maximum": 1}, "got 1.0001; expected a number <= 1"),
    (ys.number, 0, {"above": 0}, "got 0; expected a number > 0"),
    (ys.number, 1e-9, {"above": 0}, None),
    (ys.number, 0.999, {"below": 1}, None),
    (ys.number, 1, {"below": 1}, "got 1; expected a number < 1"),
    (ys.number, 0.5, {"minimum": 0.5, "below": 1}, None),
    (ys.number, 0.49, {"minimum": 0.5, "below": 1}, "got 0.49; expected a number in [0.5, 1)"),
    (ys.number, 1, {"above": 0, "maximum": 1}, None),
    (ys.number, 0, {"above": 0, "maximum": 1}, "got 0; expected a number in (0, 1]"),
    (ys.number, 3, {"integer": True, "minimum": 3}, None),
    (ys.number, 3.0, {"integer": True}, "got 3.0; expected an integer"),
    (ys.number, True, {}, "got true; expected a number"),
    (ys.number, False, {"integer": True}, "got false; expected an integer"),
    (ys.number, "5", {}, "got '5'; expected a number"),
    (ys.number, None, {}, "got null; expected a number"),
    (ys.number, [5], {}, "got a list; expected a number"),
    (ys.number, math.nan, {"finite": False}, "got nan; expected a number"),
    (ys.number, math.inf, {}, "got inf; expected a number"),
    (ys.number, math.inf, {"finite": False}, None),
    (ys.number, 10**400, {"integer": True}, None),
    (
        ys.number,
        95,
        {"minimum": 0.5, "below": 1, "what": "a fraction", "hint": "such as 0.95"},
        "got 95; expected a fraction in [0.5, 1) (such as 0.95)",
    ),
    (ys.string, "x", {}, None),
    (ys.string, "", {}, None),
    (ys.string, "", {"nonempty": True}, "got ''; expected non-empty text"),
    (ys.string, 3, {}, "got 3; expected text"),
    (ys.number, "x" * 60, {}, "got '" + "x" * 35 + "...'; expected a number"),
    (ys.boolean, True, {}, None),
    (ys.boolean, 1, {}, "got 1; expected true or false"),
    (ys.boolean, "yes", {}, "got 'yes'; expected true or false"),
    (ys.mapping, {}, {}, None),
    (ys.mapping, [1], {}, "got a list; expected a mapping"),
    (ys.sequence, [], {}, None),
    (ys.sequence, "a b", {"what": "a list of words"}, "got 'a b'; expected a list of words"),
    (ys.sequence, {"a": 1}, {}, "got a mapping; expected a list"),
]


@pytest.mark.parametrize(("check", "value", "kwargs", "message"), CHECKS)
def test_checks_at_their_boundaries(check, value, kwargs, message):
    if message is None:
        assert check(value, HERE, **kwargs) is value
        return
    with pytest.raises(SpecError) as info:
        check(value, HERE, **kwargs)
    assert str(info.value) == f"s.yaml:3: a.b: {message}."


@pytest.mark.parametrize(
    ("value", "choices", "result", "message"),
    [
        ("red", ("red", "green"), "red", None),
        ("green", Colour, Colour.GREEN, None),
        ("gren", Colour, None, "got 'gren' (did you mean 'green'?); expected one of red, green"),
        ("blue", ("red", "green"), None, "got 'blue'; expected one of red, green"),
        (True, ("red",), None, "got true; expected one of red"),
        (["red"], ("red",), None, "got a list; expected one of red"),
    ],
)
def test_enum_member(value, choices, result, message):
    if message is None:
        assert ys.enum_member(value, HERE, choices) == result
        return
    with pytest.raises(SpecError, match=f"^s\\.yaml:3: a\\.b: {re.escape(message)}\\.$"):
        ys.enum_member(value, HERE, choices)


TEXT = """\
name: x
source:
  kind: mix
  colur: red
  components:
    - {input: 5, output: 3}
    - input: 7
      weight: -1
"""


@pytest.mark.parametrize(
    ("path", "allowed", "required", "message"),
    [
        (
            ("source",),
            ("kind", "colour", "components"),
            (),
            "s.yaml:4: source: unknown key 'colur' (did you mean 'colour'?); "
            "known keys: kind, colour, components.",
        ),
        (
            ("source",),
            ("kind", "components"),
            (),
            "s.yaml:4: source: unknown key 'colur'; known keys: kind, components.",
        ),
        (
            ("source", "components", 1),
            ("input", "output", "weight"),
            ("input", "output"),
            "s.yaml:7: source.components[1]: missing key 'output'; required keys: input, output.",
        ),
        (("source", "components", 0), (), (), "s.yaml:6: source.components[0]: unknown key "),
    ],
)
def test_keys(path, allowed, required, message):
    data, root = ys.load(TEXT, "s.yaml")
    where, value = root, data
    for key in path:
        where, value = where / key, value[key]
    with pytest.raises(SpecError) as info:
        ys.keys(value, where, allowed, required)
    assert str(info.value).startswith(message)
    if not allowed:
        assert str(info.value).endswith("; known keys: none.")


def test_load_keeps_the_data_and_every_line():
    data, root = ys.load(TEXT, "s.yaml")
    assert data == yaml.safe_load(TEXT) and type(data["source"]) is dict
    weight = root / "source" / "components" / 1 / "weight"
    assert (weight.line, str(weight)) == (8, "s.yaml:8: source.components[1].weight")
    assert (root / "source" / "components" / 0 / "output").line == 6
    assert (root / "source" / "missing").line == 2  # the nearest key that is there
    assert root.line == 1 and str(root) == "s.yaml:1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "a: 1\nb: 2\na: 3\n",
            "d.yaml:3: duplicate key 'a' (first on line 1); give each key once.",
        ),
        (
            "a:\n  x: 1\n  x: 2\n",
            "d.yaml:3: duplicate key 'x' (first on line 2); give each key once.",
        ),
        ("a: [\n", "d.yaml:2: not valid YAML ("),
        ("a: 1\n\tb: 2\n", "d.yaml:2: not valid YAML ("),
    ],
)
def test_load_errors_name_the_line(text, message):
    with pytest.raises(WorkloadError) as info:
        ys.load(text, "d.yaml", error=WorkloadError)
    assert str(info.value).startswith(message) and str(info.value).endswith(".")


def test_merge_keys_are_not_duplicates():
    data, _ = ys.load("base: &b {x: 1, y: 2}\nmine:\n  <<: *b\n  x: 5\n", "m.yaml")
    assert data["mine"] == {"x": 5, "y": 2}


@pytest.mark.parametrize(
    ("text", "empty", "message"),
    [
        ("", None, "e.yaml: the document is empty; expected a mapping."),
        ("# only a comment\n", None, "e.yaml: the document is empty; expected a mapping."),
        ("- 1\n", None, "e.yaml:1: got a list; expected a mapping."),
        ("just text\n", None, "e.yaml:1: got 'just text'; expected a mapping."),
        ("", {}, None),
    ],
)
def test_document(text, empty, message):
    data, root = ys.load(text, "e.yaml")
    if message is None:
        assert ys.document(data, root, empty=empty) == {}
        return
    with pytest.raises(SpecError) as info:
        ys.document(data, root, empty=empty)
    assert str(info.value) == message


def test_relocating_places_bare_problems_and_foreign_messages():
    data, root = ys.load(TEXT, "s.yaml", error=WorkloadError)
    components = root / "source" / "components"
    with pytest.raises(WorkloadError) as info, ys.relocating(components / 1):
        ys.number(-1, ys.as_where("weight", WorkloadError), above=0)
    assert str(info.value) == (
        "s.yaml:8: source.components[1].weight: got -1; expected a number > 0."
    )
    with pytest.raises(WorkloadError) as info, ys.relocating(components / 0):
        raise WorkloadError("a message written elsewhere.")
    assert str(info.value) == "s.yaml:6: a message written elsewhere."
    with pytest.raises(WorkloadError) as info, ys.relocating(components / 0):
        (root / "name").fail("placed already")
    assert str(info.value) == "s.yaml:1: name: placed already."
    with pytest.raises(KeyError), ys.relocating(components):  # other errors pass untouched
        raise KeyError("x")


def test_bench_common_imports_none_of_the_project():
    project = {"harness", "engine_ref", "workloads", "faults", "slo", "reports"}
    for path in Path(ys.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not {n.split(".")[0] for n in names} & project, path


# -- the four validators, one mistake each, one message form --------------------------------

# (loader, its error class, a good document of two lines, a key taking an integer >= 0)
VALIDATORS = {
    "workload spec": (
        load_spec_file,
        WorkloadError,
        "name: w\nsource: {kind: synthetic, input: 8, output: 4}\n",
        "seed",
    ),
    "SLO spec": (load_slo, SLOError, "name: s\nper_request: {ttft_ms: 100}\n", "min_samples"),
    "fault plan": (
        load_plan,
        FaultPlanError,
        "name: f\nwindows: [{kind: down, for: 1}]\n",
        "seed",
    ),
    "gate config": (load_gate_config, ReportError, "min_samples: 30\nconfidence: 0.9\n", "seed"),
}
# (the mistake, written from line 3 on; the message after "<path>:<line>: ")
MISTAKES = [
    ("colour: red\n", r"unknown key 'colour'; known keys: [a-z_, ]+"),
    ("KEY: -1\n", r"KEY: got -1; expected an integer >= 0"),
    ("KEY: true\n", r"KEY: got true; expected an integer >= 0"),
    ("KEY: 1\nKEY: 2\n", r"duplicate key 'KEY' \(first on line 3\); give each key once"),
]


@pytest.mark.parametrize("name", VALIDATORS)
@pytest.mark.parametrize(("mistake", "shape"), MISTAKES)
def test_every_validator_reports_a_mistake_on_line_3_alike(tmp_path, name, mistake, shape):
    load, error, good, key = VALIDATORS[name]
    path = tmp_path / "spec.yaml"
    path.write_text(good + mistake.replace("KEY", key))
    line = 2 + mistake.count("\n")  # the mistake's last line
    with pytest.raises(error) as info:
        load(path)
    assert type(info.value) is error
    expected = rf"{re.escape(str(path))}:{line}: {shape.replace('KEY', key)}\."
    assert re.fullmatch(expected, str(info.value))


@pytest.mark.parametrize("name", VALIDATORS)
def test_every_validator_reads_its_good_example(tmp_path, name):
    load, _, good, _ = VALIDATORS[name]
    path = tmp_path / "spec.yaml"
    path.write_text(good)
    load(path)
