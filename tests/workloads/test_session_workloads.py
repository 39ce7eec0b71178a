"""Session workloads: one row per turn with session id, turn index, the session's arrival on
its first turn and think times on the others; synthetic and ShareGPT (every turn) sources."""

from __future__ import annotations

import json

import pytest

from workloads import WorkloadError, WorkloadOptions, resolve_workload
from workloads.spec import parse_spec

SYNTHETIC = """\
name: s
num_requests: 5
seed: 3
endpoint: chat
source:
  kind: sessions
  turns: {dist: uniform, low: 1, high: 4}
  input: {dist: uniform, low: 8, high: 20}
  output: 6
  think_ms: {dist: fixed, value: 250}
arrivals: {process: poisson, rate: 2}
"""


def _build(tmp_path, text: str, tokenizer, **options):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return resolve_workload(
        str(path), options=WorkloadOptions(**options), tokenizer=tokenizer, use_cache=False
    )


def test_synthetic_sessions_one_row_per_turn(tmp_path, tiny_tokenizer):
    w = _build(tmp_path, SYNTHETIC, tiny_tokenizer)
    rows = w.table.to_pylist()
    sessions: dict[str, list[dict]] = {}
    for r in rows:
        sessions.setdefault(r["session_id"], []).append(r)
    assert len(sessions) == 5 == w.manifest["num_sessions"]
    assert w.manifest["num_requests"] == len(rows) == sum(len(v) for v in sessions.values())
    arrivals = []
    for turns in sessions.values():
        assert [r["turn_index"] for r in turns] == list(range(len(turns)))
        assert 1 <= len(turns) <= 4
        first, rest = turns[0], turns[1:]
        assert first["arrival_s"] is not None and first["think_s"] is None
        arrivals.append(first["arrival_s"])
        assert all(r["arrival_s"] is None and r["think_s"] == 0.25 for r in rest)
        for r in turns:
            assert 8 <= r["input_tokens"] <= 20 and r["max_output_tokens"] == 6
            assert tiny_tokenizer.encode(r["prompt"]) == r["prompt_token_ids"]
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(2.5)  # 5 at 2/s
    assert "sessions" in w.manifest["prompt_format"]
    # the same spec builds the same table
    assert _build(tmp_path, SYNTHETIC, tiny_tokenizer).manifest["sha256"] == w.manifest["sha256"]


def test_sharegpt_sessions_keep_every_turn(tmp_path, tiny_tokenizer):
    data = [
        {"conversations": [
            {"from": "human", "value": "Hello there, how are you?"},
            {"from": "gpt", "value": "I am fine, thank you for asking!"},
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris."},
            {"from": "human", "value": "unanswered"},
        ]},
        {"conversations": [
            {"from": "gpt", "value": "leading answer"},
            {"from": "human", "value": "Numbers such as 42?"},
            {"from": "gpt", "value": "Yes, 42 and 256."},
        ]},
        {"conversations": [{"from": "human", "value": "alone"}, {"from": "human", "value": "x"}]},
    ]  # fmt: skip
    (tmp_path / "sg.json").write_text(json.dumps(data))
    text = "name: sg\nnum_requests: 3\nsource: {kind: sessions, path: sg.json, shuffle: false}\n"
    w = _build(tmp_path, text, tiny_tokenizer)
    rows = w.table.to_pylist()
    # the two conversations with answered turns, the first reused for the third session
    assert [(r["session_id"], r["turn_index"], r["prompt"]) for r in rows] == [
        ("sess-0000", 0, "Hello there, how are you?"),
        ("sess-0000", 1, "What is the capital of France?"),
        ("sess-0001", 0, "Numbers such as 42?"),
        ("sess-0002", 0, "Hello there, how are you?"),
        ("sess-0002", 1, "What is the capital of France?"),
    ]
    assert rows[1]["max_output_tokens"] == len(tiny_tokenizer.encode("Paris."))
    assert w.manifest["synthetic"] is False
    assert w.manifest["parameters"]["effective"]["sharegpt_file"]["reused_conversations"] == 1
    capped = _build(
        tmp_path,
        text.replace("shuffle: false", "shuffle: false, max_turns: 1"),
        tiny_tokenizer,
        output_len=5,
    )
    assert [r["turn_index"] for r in capped.table.to_pylist()] == [0, 0, 0]
    assert set(capped.table.column("max_output_tokens").to_pylist()) == {5}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "{kind: sessions, input: 8, output: 4}",
            r"x\.yaml:2: source: missing key 'turns'; synthetic sessions need turns, input and "
            "output",
        ),
        (
            "{kind: sessions, path: x.json, turns: 2}",
            r"x\.yaml:2: source: path and turns/input are both given; expected either path .* or "
            "turns and input",
        ),
        (
            "{kind: sessions, turns: 2, input: 8, output: 4, max_turns: 0}",
            r"x\.yaml:2: source\.max_turns: got 0; expected an integer >= 1",
        ),
        (
            "{kind: sessions, turns: 2, input: 8, output: 4, rounds: 3}",
            r"x\.yaml:2: source: unknown key 'rounds'; known keys: kind, turns",
        ),
        (
            "{kind: sessions, turns: 2, input: 8, output: 4}\nprefix: {groups: 2, prefix_len: 8}",
            r"x\.yaml:3: prefix: shared prefixes do not apply to this sessions source",
        ),
    ],
)
def test_bad_session_specs_name_the_problem(source, message):
    with pytest.raises(WorkloadError, match=message):
        parse_spec(f"name: x\nsource: {source}\n", "x.yaml")
