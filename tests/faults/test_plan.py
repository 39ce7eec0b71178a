"""Fault plans: schema errors (one sentence naming the field), built-ins, sha256, window
activation at its boundaries, and the `bench faults` commands."""

from __future__ import annotations

import copy
import math

import pytest
import yaml
from click.testing import CliRunner

from faults.cli import faults
from faults.plan import (
    FaultPlan,
    FaultPlanError,
    builtin_plan_names,
    builtin_plan_text,
    load_plan,
    parse_plan,
)
from faults.retry import RetryPolicy
from faults.window import Direction, FaultKind, Layer, Window, WindowTracker, parse_seconds

BASE = {
    "name": "t",
    "description": "a test plan",
    "seed": 3,
    "windows": [
        {
            "kind": "reset_peer",
            "at": "5s",
            "for": "10s",
            "fraction": 0.5,
            "direction": "downstream",
            "params": {"timeout_ms": 100},
        },
        {"kind": "cancel", "after_requests": 20, "params": {"after_tokens": 3}},
    ],
    "retry": {"enabled": True, "max_attempts": 2},
}


def _with(path: tuple, value) -> dict:
    """BASE with the entry at `path` (keys and list indexes) set to `value`."""
    data = copy.deepcopy(BASE)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


W0 = ("windows", 0)
W1 = ("windows", 1)
FRACTION = "windows[0].fraction: got {}; expected a fraction in [0, 1] (0.5 affects half)"
# (mutation path, value, words the message must contain)
BAD = [
    (("colour",), "red", ["unknown key 'colour'", "known keys: name"]),
    ((*W0, "start"), 5, ["windows[0]: unknown key 'start'", "after_requests"]),
    ((*W0, "params"), {"timeout": 1}, ["windows[0].params: unknown key 'timeout'", "timeout_ms"]),
    ((*W0, "params"), [1], ["windows[0].params: got a list; expected a mapping"]),
    (
        (*W0, "kind"),
        "explode",
        ["windows[0].kind: got 'explode'; expected one of", "reset_peer", "kill_engine"],
    ),
    (("windows",), {"kind": "down"}, ["windows: got a mapping; expected a list"]),
    (("windows",), ["down"], ["windows[0]: got 'down'; expected a mapping"]),
    (("seed",), "x", ["seed: got 'x'; expected an integer"]),
    (("seed",), -1, ["seed: got -1; expected an integer >= 0"]),
    (("name",), "", ["name: got ''; expected non-empty text"]),
    (("description",), 3, ["description: got 3; expected text"]),
    ((*W0, "fraction"), "half", [FRACTION.format("'half'")]),
    ((*W0, "fraction"), 1.5, [FRACTION.format("1.5")]),
    ((*W0, "fraction"), -0.1, [FRACTION.format("-0.1")]),
    ((*W0, "fraction"), True, [FRACTION.format("true")]),
    ((*W0, "at"), "-5s", ["windows[0].at: got '-5s'; expected a duration >= 0 such as 5, 5s"]),
    ((*W0, "at"), -1, ["windows[0].at: got -1; expected a duration >= 0"]),
    ((*W0, "for"), "-1s", ["windows[0].for: got '-1s'; expected a duration >= 0"]),
    ((*W0, "for"), "5 hours", ["windows[0].for: got '5 hours'; expected a duration >= 0"]),
    ((*W0, "for"), 0, ["windows[0].for: got 0; expected a duration > 0, or no for to last"]),
    ((*W0, "at"), math.inf, ["windows[0].at: got inf; expected a duration >= 0"]),
    ((*W1, "after_requests"), -3, ["windows[1].after_requests: got -3; expected an integer >= 0"]),
    ((*W1, "after_requests"), 2.5, ["windows[1].after_requests: got 2.5; expected an integer"]),
    ((*W1, "at"), 1, ["windows[1].after_requests: given with at; give either at or after_"]),
    (
        (*W1, "direction"),
        "both",
        ["windows[1].direction: given for cancel, a client kind; drop it (only network kinds"],
    ),
    (
        (*W0, "direction"),
        "sideways",
        ["windows[0].direction: got 'sideways'; expected one of", "upstream"],
    ),
    (
        (*W0, "params"),
        {"timeout_ms": -1},
        ["windows[0].params.timeout_ms: got -1; expected a number >= 0"],
    ),
    (
        (*W0, "params"),
        {"timeout_ms": "1"},
        ["windows[0].params.timeout_ms: got '1'; expected a number >= 0"],
    ),
    (
        (*W1, "params"),
        {},
        ["windows[1].params: got neither; cancel needs exactly one of params.after_tokens and"],
    ),
    (
        (*W1, "params"),
        {"after_tokens": 2, "after_ms": 5},
        ["windows[1].params: got after_tokens and after_ms; cancel needs exactly one"],
    ),
    (
        (*W1, "params"),
        {"after_tokens": 0},
        ["windows[1].params.after_tokens: got 0; expected an integer >= 1"],
    ),
    (
        (*W1,),
        {"kind": "latency"},
        ["windows[1].params: missing key 'latency_ms'; latency needs params.latency_ms"],
    ),
    (
        (*W1,),
        {"kind": "pause_engine"},
        ["windows[1]: missing key 'for'; pause_engine needs for"],
    ),
    (
        (*W1,),
        {"kind": "kill_engine", "fraction": 0.5},
        ["windows[1].fraction: got 0.5, but kill_engine acts on the whole target; drop it"],
    ),
    (
        (*W1,),
        {"kind": "pause_engine", "for": 1, "params": {"x": 1}},
        ["windows[1].params: unknown key 'x'; known keys: none"],
    ),
    ((*W1,), {"at": 1}, ["windows[1]: missing key 'kind'; required keys: kind"]),
    (
        (*W1,),
        {"kind": "down", "fraction": 0.5},
        ["windows[1].fraction: got 0.5, but down acts on the whole target; drop it"],
    ),
    (
        (*W1,),
        {"kind": "down", "params": {"reset_open": 2}},
        ["windows[1].params.reset_open: got 2; expected 0 or 1"],
    ),
    (
        (*W1,),
        {"kind": "slicer", "params": {"average_size": 10, "size_variation": 10}},
        ["windows[1].params.size_variation: got 10 with average_size 10; slicer needs params."],
    ),
    (
        (*W1,),
        {"kind": "bandwidth", "params": {"rate_kbps": 0}},
        ["windows[1].params.rate_kbps: got 0; expected a number > 0"],
    ),
    (
        (*W1,),
        {"kind": "slow_reader", "params": {"read_delay_ms": 5, "read_bytes": 1.5}},
        ["windows[1].params.read_bytes: got 1.5; expected an integer >= 1"],
    ),
    (
        (*W1,),
        {"kind": "disconnect_storm", "params": {"min_ms": 500, "max_ms": 100}},
        ["windows[1].params.min_ms: got 500 with max_ms 100; disconnect_storm needs params.min_ms"],
    ),
    (
        ("windows",),
        [{"kind": "slow_reader", "params": {"read_delay_ms": 5}}] * 2,
        ["one slow_reader window"],
    ),
    (("retry",), {"tries": 3}, ["retry: unknown key 'tries'", "max_attempts"]),
    (("retry",), {"max_attempts": 0}, ["retry.max_attempts: got 0; expected an integer >= 1"]),
    (
        ("retry",),
        {"statuses": [200]},
        ["retry.statuses[0]: got 200; expected an HTTP error code in [400, 599]"],
    ),
    (
        ("retry",),
        {"statuses": 429},
        ["retry.statuses: got 429; expected a list of HTTP error codes such as [429, 503]"],
    ),
    (("retry",), {"enabled": "yes"}, ["retry.enabled: got 'yes'; expected true or false"]),
    (("retry",), {"backoff_ms": -5}, ["retry.backoff_ms: got -5; expected a number > 0"]),
    (
        ("retry",),
        {"backoff_ms": 500, "max_backoff_ms": 100},
        ["retry.max_backoff_ms: got 100, below backoff_ms 500; expected a number >= backoff_ms"],
    ),
    (("retry",), [1], ["retry: got a list; expected a mapping"]),
    (("engine_args",), "--num-blocks 16", ["engine_args: got '--num-blocks 16'; expected a list"]),
    (("engine_args",), ["--num-blocks", ""], ["engine_args[1]: got ''; expected a non-empty arg"]),
    (("engine_args",), [{"num_blocks": 16}], ["engine_args[0]: got a mapping; expected a non-"]),
    (("engine_args",), [True], ["engine_args[0]: got true; expected a non-empty argument"]),
]


@pytest.mark.parametrize(("path", "value", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_every_schema_violation_is_one_sentence_naming_the_field(path, value, words):
    with pytest.raises(FaultPlanError) as info:
        FaultPlan.from_dict(_with(path, value), "plan.yaml")
    message = str(info.value)
    assert message.startswith("plan.yaml")
    assert message.endswith(".") and "\n" not in message
    for word in words:
        assert word in message


def test_missing_name_and_not_a_mapping():
    with pytest.raises(
        FaultPlanError, match=r"^plan\.yaml: missing key 'name'; required keys: name\.$"
    ):
        FaultPlan.from_dict({"windows": []}, "plan.yaml")
    with pytest.raises(FaultPlanError, match=r"^plan\.yaml: got a list; expected a mapping\.$"):
        FaultPlan.from_dict([1], "plan.yaml")


def test_invalid_yaml_names_the_line():
    with pytest.raises(
        FaultPlanError, match=r"^p\.yaml:3: not valid YAML \(.*\); fix its syntax\.$"
    ):
        parse_plan("name: x\nwindows: [\n", "p.yaml")


LINES_PLAN = """\
name: p
windows:
  - kind: down
  - kind: reset_peer
    WINDOW
retry:
  RETRY
"""


@pytest.mark.parametrize(
    ("window", "retry", "message"),
    [
        (
            "fraktion: 0.5",
            "max_attempts: 2",
            r"^p\.yaml:5: windows\[1\]: unknown key 'fraktion' \(did you mean 'fraction'\?\); "
            r"known keys: kind, at, ",
        ),
        ("kind: down", "max_attempts: 2", r"^p\.yaml:5: duplicate key 'kind' \(first on line 4\)"),
        ("direction: sideways", "max_attempts: 2", r"^p\.yaml:5: windows\[1\]\.direction: got "),
        (
            "fraction: 2",
            "max_attempts: 2",
            r"^p\.yaml:5: windows\[1\]\.fraction: got 2; expected a fraction in \[0, 1\]",
        ),
        ("at: 1", "tries: 2", r"^p\.yaml:7: retry: unknown key 'tries'; known keys: enabled, "),
        ("at: 1", "max_attempts: 0", r"^p\.yaml:7: retry\.max_attempts: got 0; expected an int"),
        (
            "params:\n      timeout_ms: -1",
            "max_attempts: 2",
            r"^p\.yaml:6: windows\[1\]\.params\.timeout_ms: got -1; expected a number >= 0\.$",
        ),
        (
            "at: 1\n    after_requests: 3",
            "max_attempts: 2",
            r"^p\.yaml:6: windows\[1\]\.after_requests: given with at; give either at or ",
        ),
        ("for: 0s", "max_attempts: 2", r"^p\.yaml:5: windows\[1\]\.for: got '0s'; expected a du"),
        (
            "at: 1",
            "statuses:\n    - 429\n    - 200",
            r"^p\.yaml:9: retry\.statuses\[1\]: got 200; expected an HTTP error code in "
            r"\[400, 599\]\.$",
        ),
        (
            "at: 1",
            "backoff_ms: 500\n  max_backoff_ms: 100",
            r"^p\.yaml:8: retry\.max_backoff_ms: got 100, below backoff_ms 500; ",
        ),
    ],
)
def test_plan_file_errors_name_the_line(window, retry, message):
    text = LINES_PLAN.replace("WINDOW", window).replace("RETRY", retry)
    with pytest.raises(FaultPlanError, match=message):
        parse_plan(text, "p.yaml")


# Each limit of a window field: (a window, the message after "b: windows[0]", None: accepted)
WINDOW_LIMITS = [
    ({"kind": "stall", "fraction": -1e-9}, ".fraction: got -1e-09; expected a fraction in [0, 1]"),
    ({"kind": "stall", "fraction": 0}, None),
    ({"kind": "stall", "fraction": 1}, None),
    ({"kind": "stall", "fraction": 1 + 1e-9}, ".fraction: got 1.000000001; expected a fraction"),
    ({"kind": "stall", "at": -0.001}, ".at: got -0.001; expected a duration >= 0 such as 5,"),
    ({"kind": "stall", "at": "-1ms"}, ".at: got '-1ms'; expected a duration >= 0 such as 5,"),
    ({"kind": "stall", "at": 0}, None),
    ({"kind": "stall", "at": "0ms"}, None),
    ({"kind": "stall", "for": -0.001}, ".for: got -0.001; expected a duration >= 0"),
    ({"kind": "stall", "for": 0}, ".for: got 0; expected a duration > 0, or no for to last until"),
    ({"kind": "stall", "for": "0ms"}, ".for: got '0ms'; expected a duration > 0"),
    ({"kind": "stall", "for": "1ms"}, None),
    ({"kind": "stall", "after_requests": -1}, ".after_requests: got -1; expected an integer >= 0"),
    ({"kind": "stall", "after_requests": 0}, None),
    ({"kind": "stall", "after_requests": 1}, None),
    ({"kind": "latency", "params": {"latency_ms": -0.001}}, ".params.latency_ms: got -0.001;"),
    ({"kind": "latency", "params": {"latency_ms": 0}}, None),
    ({"kind": "bandwidth", "params": {"rate_kbps": 0}}, ".params.rate_kbps: got 0; expected a "),
    ({"kind": "bandwidth", "params": {"rate_kbps": 0.001}}, None),
    ({"kind": "slicer", "params": {"average_size": 0.999}}, ".params.average_size: got 0.999; e"),
    ({"kind": "slicer", "params": {"average_size": 1}}, None),
    ({"kind": "cancel", "params": {"after_tokens": 0}}, ".params.after_tokens: got 0; expected"),
    ({"kind": "cancel", "params": {"after_tokens": 1}}, None),
    ({"kind": "cancel", "params": {"after_ms": 0}}, ".params.after_ms: got 0; expected a number >"),
    ({"kind": "cancel", "params": {"after_ms": 0.001}}, None),
    (
        {"kind": "disconnect_storm", "params": {"min_ms": 100, "max_ms": 100}},
        ".params.min_ms: got 100 with max_ms 100; disconnect_storm needs params.min_ms below max_ms",
    ),
    ({"kind": "disconnect_storm", "params": {"min_ms": 99.999, "max_ms": 100}}, None),
    ({"kind": "disconnect_storm", "params": {"min_ms": -0.001}}, ".params.min_ms: got -0.001;"),
    ({"kind": "disconnect_storm", "params": {"min_ms": 0}}, None),
    ({"kind": "slow_reader", "params": {"read_delay_ms": 5, "read_bytes": 0}}, ".params.read_b"),
    ({"kind": "slow_reader", "params": {"read_delay_ms": 5, "read_bytes": 1}}, None),
]
# Each limit of a retry field: (the retry mapping, the message after "b: retry", None: accepted)
RETRY_LIMITS = [
    ({"max_attempts": 0}, ".max_attempts: got 0; expected an integer >= 1"),
    ({"max_attempts": 1}, None),
    ({"max_attempts": 2}, None),
    ({"statuses": [399]}, ".statuses[0]: got 399; expected an HTTP error code in [400, 599]"),
    ({"statuses": [400]}, None),
    ({"statuses": [599]}, None),
    ({"statuses": [429, 600]}, ".statuses[1]: got 600; expected an HTTP error code in [400, 599]"),
    ({"statuses": []}, None),
    ({"backoff_ms": 0}, ".backoff_ms: got 0; expected a number > 0"),
    ({"backoff_ms": 0.001}, None),
    ({"max_backoff_ms": 0}, ".max_backoff_ms: got 0; expected a number > 0"),
    ({"backoff_ms": 100, "max_backoff_ms": 100}, None),
    (
        {"backoff_ms": 100, "max_backoff_ms": 99.999},
        ".max_backoff_ms: got 99.999, below backoff_ms 100; expected a number >= backoff_ms",
    ),
]


def _problem(data: dict) -> str | None:
    """The message of the plan `data` in a document named `b`; None when it is accepted."""
    try:
        FaultPlan.from_dict(data, "b")
    except FaultPlanError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("window", "message"), WINDOW_LIMITS, ids=str)
def test_each_limit_of_a_window_field(window, message):
    problem = _problem({"name": "t", "windows": [window]})
    if message is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(f"b: windows[0]{message}")
        assert problem.endswith(".") and "\n" not in problem


@pytest.mark.parametrize(("retry", "message"), RETRY_LIMITS, ids=str)
def test_each_limit_of_a_retry_field(retry, message):
    problem = _problem({"name": "t", "retry": {"enabled": True, **retry}})
    if message is None:
        assert problem is None
        read = FaultPlan.from_dict({"name": "t", "retry": retry}).retry.to_dict()
        assert {key: read[key] for key in retry} == retry
    else:
        assert problem is not None and problem.startswith(f"b: retry{message}")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (5, 5.0),
        (0.5, 0.5),
        ("5", 5.0),
        ("5s", 5.0),
        ("500ms", 0.5),
        (" 1.5 s ", 1.5),
        ("2m", 120.0),
    ],
)
def test_durations(text, seconds):
    assert parse_seconds(text, "at") == seconds


def test_a_window_reads_its_defaults():
    plan = FaultPlan.from_dict(BASE)
    reset, cancel = plan.windows
    assert (reset.kind, reset.layer, reset.at_s, reset.for_s) == (
        FaultKind.RESET_PEER,
        Layer.NETWORK,
        5.0,
        15.0 - 5.0,
    )
    assert reset.direction is Direction.DOWNSTREAM and reset.param("timeout_ms") == 100.0
    assert (cancel.at_s, cancel.after_requests, cancel.for_s, cancel.fraction) == (
        None,
        20,
        None,
        1.0,
    )
    assert cancel.direction is None
    down = Window(kind="down")
    assert (down.at_s, down.direction, down.params) == (
        0.0,
        Direction.DOWNSTREAM,
        (("reset_open", 1.0),),
    )
    assert Window(kind="latency", params=(("latency_ms", 5),)).param("jitter_ms") == 0.0
    assert plan.retry == RetryPolicy(enabled=True, max_attempts=2)


EXPECTED_BUILTINS = {
    "latency-200ms",
    "reset-storm",
    "stall",
    "limit-data",
    "down",
    "cancel-storm",
    "slow-readers",
    "kill-engine",
    "pause-engine",
    "slow-steps",
    "shrunken-kv",
}


def test_builtins_load_by_name_with_or_without_suffix():
    names = builtin_plan_names()
    assert EXPECTED_BUILTINS <= set(names)
    for name in names:
        plan = load_plan(name)
        assert plan.name == name and plan.description
        assert load_plan(f"{name}.yaml") == plan
        assert parse_plan(builtin_plan_text(name), name) == plan


def test_builtin_layers():
    assert load_plan("reset-storm").needs_proxy
    assert not load_plan("reset-storm").needs_managed_engine
    assert load_plan("kill-engine").needs_managed_engine
    assert load_plan("pause-engine").kinds_by_layer == {Layer.ENGINE: (FaultKind.PAUSE_ENGINE,)}
    cancel = load_plan("cancel-storm")
    assert cancel.has_client_faults and not cancel.needs_proxy
    assert FaultPlan.from_dict(BASE).kinds_by_layer == {
        Layer.NETWORK: (FaultKind.RESET_PEER,),
        Layer.CLIENT: (FaultKind.CANCEL,),
    }


def test_engine_args_start_a_managed_engine_and_slow_steps_add_the_fault_route():
    kv = load_plan("shrunken-kv")
    assert kv.engine_args == ("--num-blocks", "64") and kv.needs_managed_engine
    assert kv.managed_engine_args == ("--num-blocks", "64") and not kv.windows
    numbers = FaultPlan.from_dict({"name": "n", "engine_args": ["--num-blocks", 16, 0.5]})
    assert numbers.engine_args == ("--num-blocks", "16", "0.5")  # YAML numbers become text
    assert FaultPlan.from_dict(numbers.to_dict()) == numbers
    slow = load_plan("slow-steps")
    assert slow.managed_engine_args == ("--enable-fault-injection",)
    assert slow.kinds_by_layer == {Layer.ENGINE: (FaultKind.SLOW_STEPS,)}
    assert "engine_args" not in load_plan("reset-storm").to_dict()  # old hashes unchanged
    assert load_plan("reset-storm").managed_engine_args == ()


def test_unknown_name_lists_the_builtins_and_a_file_path_wins(tmp_path, monkeypatch):
    with pytest.raises(FaultPlanError) as info:
        load_plan("reset-strom")
    assert "'reset-strom'" in str(info.value) and "reset-storm" in str(info.value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stall.yaml").write_text("name: mine\nwindows: [{kind: down}]\n")
    assert load_plan("stall.yaml").name == "mine"
    assert load_plan("stall").name == "stall"


def test_to_dict_round_trips_through_json_and_yaml():
    plan = FaultPlan.from_dict(BASE)
    assert FaultPlan.from_dict(plan.to_dict()) == plan
    assert parse_plan(yaml.safe_dump(plan.to_dict()), "again") == plan
    for name in builtin_plan_names():
        built = load_plan(name)
        assert FaultPlan.from_dict(built.to_dict()).sha256 == built.sha256


def test_sha256_is_pinned_for_a_minimal_plan():
    # Pinned: manifests compare plans by this digest, so its canonical form must not drift.
    plan = FaultPlan(name="x")
    assert plan.sha256 == "e13d804041a26558621f436fa5c5dce5886fdf29719024d1ca2446a573d93ddf"


def test_equal_spellings_have_one_digest():
    a = FaultPlan.from_dict(_with((*W0, "at"), "5s"))
    b = FaultPlan.from_dict(_with((*W0, "at"), "5000ms"))
    c = FaultPlan.from_dict(_with((*W0, "at"), 5))
    assert a.sha256 == b.sha256 == c.sha256 == FaultPlan.from_dict(BASE).sha256
    explicit = _with(W1, {**BASE["windows"][1], "fraction": 1})
    assert FaultPlan.from_dict(explicit).sha256 == a.sha256


CHANGES = [
    (("name",), "u"),
    (("description",), "other"),
    (("seed",), 4),
    (W0, {**BASE["windows"][0], "kind": "stall", "params": {}}),
    ((*W0, "at"), "6s"),
    ((*W0, "for"), "11s"),
    ((*W0, "fraction"), 0.25),
    ((*W0, "direction"), "upstream"),
    ((*W0, "params"), {"timeout_ms": 101}),
    ((*W1, "after_requests"), 21),
    ((*W1, "params"), {"after_ms": 3}),
    (("windows",), [BASE["windows"][1], BASE["windows"][0]]),
    (("retry",), {"enabled": False, "max_attempts": 2}),
    (("retry",), {"enabled": True, "max_attempts": 3}),
    (("retry",), {"enabled": True, "max_attempts": 2, "honour_retry_after": False}),
    (("retry",), {"enabled": True, "max_attempts": 2, "statuses": [429]}),
    (("retry",), {"enabled": True, "max_attempts": 2, "backoff_ms": 50}),
    (("retry",), {"enabled": True, "max_attempts": 2, "max_backoff_ms": 500}),
    (("engine_args",), ["--num-blocks", "16"]),
]


@pytest.mark.parametrize(("path", "value"), CHANGES, ids=[str(c[0]) for c in CHANGES])
def test_sha256_changes_with_any_field(path, value):
    base = FaultPlan.from_dict(BASE)
    changed = FaultPlan.from_dict(_with(path, value))
    assert changed.sha256 != base.sha256
    assert FaultPlan.from_dict(BASE).sha256 == base.sha256


TIMED = Window(kind="stall", at_s=5.0, for_s=10.0)


@pytest.mark.parametrize(
    ("elapsed_s", "active"),
    [(4.999, False), (5.0, True), (5.001, True), (14.999, True), (15.0, False), (15.001, False)],
)
def test_a_timed_window_is_half_open(elapsed_s, active):
    plan = FaultPlan(name="t", windows=(TIMED,))
    assert TIMED.is_active(elapsed_s, 0) is active
    assert plan.active_windows(elapsed_s, 10_000) == ([TIMED] if active else [])


COUNTED = Window(kind="stall", after_requests=20, for_s=10.0)


@pytest.mark.parametrize(
    ("elapsed_s", "sent", "trigger_s", "active"),
    [
        (50.0, 19, None, False),  # one request short
        (3.0, 20, 3.0, True),  # the moment the 20th went out
        (3.001, 21, 3.0, True),
        (12.999, 40, 3.0, True),
        (13.0, 40, 3.0, False),  # for 10 s from the trigger
        (13.001, 40, 3.0, False),
        (99.0, 20, None, True),  # trigger time unknown: fired now
    ],
)
def test_a_request_count_window_starts_at_its_trigger(elapsed_s, sent, trigger_s, active):
    assert COUNTED.is_active(elapsed_s, sent, trigger_s) is active
    plan = FaultPlan(name="t", windows=(TIMED, COUNTED))
    found = plan.active_windows(elapsed_s, sent, {1: trigger_s} if trigger_s is not None else None)
    assert (COUNTED in found) is active


def test_open_ended_windows_and_bounds():
    forever = Window(kind="down", at_s=2.0)
    counted = Window(kind="down", after_requests=0)
    plan = FaultPlan(name="t", windows=(forever, counted, TIMED))
    assert not forever.is_active(1.999, 0) and forever.is_active(1e9, 0)
    assert counted.is_active(0.0, 0)
    assert plan.window_bounds() == [(2.0, math.inf), None, (5.0, 15.0)]
    assert plan.window_bounds({1: 4.0}) == [(2.0, math.inf), (4.0, math.inf), (5.0, 15.0)]


def test_the_tracker_remembers_when_a_trigger_fired():
    plan = FaultPlan(name="t", windows=(COUNTED,))
    tracker = WindowTracker(plan)
    assert tracker.poll(1.0, 19) == []
    assert tracker.poll(2.0, 20) == [COUNTED]
    assert tracker.poll(11.999, 30) == [COUNTED]
    assert tracker.poll(12.0, 30) == []
    assert tracker.trigger_s == {0: 2.0}


@pytest.mark.parametrize(
    ("retry", "retry_after_s", "wait_s"),
    [(1, None, 0.1), (2, None, 0.2), (3, None, 0.4), (9, None, 1.0), (1, 0.7, 0.7), (1, 30.0, 1.0)],
)
def test_retry_waits(retry, retry_after_s, wait_s):
    policy = RetryPolicy(enabled=True, backoff_ms=100, max_backoff_ms=1000)
    assert policy.wait_s(retry, retry_after_s) == pytest.approx(wait_s)
    ignoring = RetryPolicy(enabled=True, honour_retry_after=False, backoff_ms=100)
    assert ignoring.wait_s(1, 5.0) == pytest.approx(0.1)


def test_cli_list_and_show(tmp_path):
    runner = CliRunner()
    listed = runner.invoke(faults, ["list"])
    assert listed.exit_code == 0
    lines = listed.output.splitlines()
    assert [line.split()[0] for line in lines] == builtin_plan_names()
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)
    shown = runner.invoke(faults, ["show", "reset-storm"])
    assert shown.exit_code == 0 and shown.output == builtin_plan_text("reset-storm").rstrip() + "\n"
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nwindows: [{kind: down}]\n")
    assert runner.invoke(faults, ["show", str(path)]).output == path.read_text()
    unknown = runner.invoke(faults, ["show", "nope"])
    assert unknown.exit_code == 2 and "built-ins: cancel-storm" in unknown.output
    path.write_text("name: bad\nwindows: [{kind: boom}]\n")
    bad = runner.invoke(faults, ["show", str(path)])
    assert bad.exit_code == 2 and "mine.yaml:2: windows[0].kind: got 'boom'" in bad.output
