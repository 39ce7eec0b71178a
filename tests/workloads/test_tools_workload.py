"""The `tools` workload: a generated bank of function schemas (every JSON kind present, every
schema valid and closed), BFCL-shaped simple and parallel requests offering a few functions
each, the same from the same seed, carried to each row as a shared `ToolOffer`; and the spec
keys `tools` and `tool_choice`, whose mistakes are one sentence each."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from workloads import WorkloadOptions, resolve_workload
from workloads.schema import WorkloadError
from workloads.spec import parse_spec
from workloads.tool_bank import KINDS, field_kind, make_bank, make_request
from workloads.tools import ToolOffer, offers_by_row

jsonschema = pytest.importorskip("jsonschema")


def _build(tokenizer, n: int = 40, seed: int | None = None):
    options = WorkloadOptions(num_requests=n, seed=seed)
    return resolve_workload("tools", options=options, tokenizer=tokenizer, use_cache=False)


def test_the_bank_has_every_kind_and_valid_closed_schemas():
    bank = make_bank(np.random.default_rng(0), 12)
    assert len(bank) == 12 and len({f["name"] for f in bank}) == 12
    kinds = set()
    for function in bank:
        parameters = function["parameters"]
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
        assert parameters["additionalProperties"] is False
        assert 1 <= len(parameters["required"]) <= len(parameters["properties"]) <= 4
        kinds |= {field_kind(s) for s in parameters["properties"].values()}
    assert kinds == set(KINDS)


@pytest.mark.parametrize("size", [1, 5, 18])
def test_every_kind_is_present_from_five_functions(size):
    bank = make_bank(np.random.default_rng(3), size)
    kinds = {field_kind(s) for f in bank for s in f["parameters"]["properties"].values()}
    assert len(bank) == size
    assert kinds == set(KINDS) or size < len(KINDS)


@pytest.mark.parametrize("size", [0, 19])
def test_a_bank_size_out_of_range_is_refused(size):
    with pytest.raises(ValueError, match="1 to 18 functions"):
        make_bank(np.random.default_rng(0), size)


@pytest.mark.parametrize("parallel, calls", [(False, {1}), (True, {2, 3})])
def test_requests_ask_for_valid_calls_of_offered_functions(parallel, calls):
    rng = np.random.default_rng(1)
    bank = make_bank(rng, 12)
    seen = set()
    for _ in range(30):
        request = make_request(bank, rng, offered=4, parallel=parallel)
        assert len(request.offer) == len(set(request.offer)) == 4
        seen.add(len(request.calls))
        for call in request.calls:
            assert call.function in request.offer
            function = bank[call.function]
            jsonschema.validate(call.arguments, function["parameters"])
            assert function["name"] in request.prompt
    assert seen == calls


def test_one_offered_function_serves_a_parallel_request():
    rng = np.random.default_rng(2)
    bank = make_bank(rng, 3)
    request = make_request(bank, rng, offered=1, parallel=True)
    assert len(request.offer) == 1 and len(request.calls) in (2, 3)
    assert {c.function for c in request.calls} == set(request.offer)


def test_the_builtin_is_deterministic_and_carries_offers_to_rows(bpe_tokenizer):
    a, b = _build(bpe_tokenizer), _build(bpe_tokenizer)
    assert a.manifest["sha256"] == b.manifest["sha256"]
    assert a.manifest["tools"] == b.manifest["tools"]
    assert _build(bpe_tokenizer, seed=1).manifest["tools"] != a.manifest["tools"]
    tools = a.manifest["tools"]
    assert tools["tool_choice"] == "required" and len(tools["functions"]) == 12
    assert len(tools["offers"]) == len(tools["parallel"]) == len(tools["calls"]) == 40
    assert 0 < sum(tools["parallel"]) < 40  # both categories
    for parallel, calls in zip(tools["parallel"], tools["calls"], strict=True):
        assert calls in ((2, 3) if parallel else (1,))
    assert a.manifest["endpoint"] == "chat"
    json.dumps(a.manifest)  # JSON-safe
    offers = offers_by_row(tools, 40)
    first = offers[0]
    assert isinstance(first, ToolOffer) and len(first.functions) == 4
    assert first.parallel == tools["parallel"][0] and first.choice == "required"
    names = {f["name"] for f in first.functions}
    prompt = a.table.column("prompt")[0].as_py()
    assert any(name in prompt for name in names)
    assert a.table.column("input_tokens").to_pylist() == [
        len(bpe_tokenizer.encode(p)) for p in a.table.column("prompt").to_pylist()
    ]


def test_rows_with_the_same_offer_share_one_object():
    functions = [{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]
    tools = {"tool_choice": "auto", "functions": functions,
             "offers": [[0], [1], [0], [0]], "parallel": [False, False, False, True]}  # fmt: skip
    rows = offers_by_row(tools, 4)
    assert rows[0] is rows[2] and rows[0] is not rows[1] and rows[0] is not rows[3]
    every = offers_by_row({"tool_choice": "none", "functions": functions}, 3)
    assert every[0] is every[2] and every[0].parallel is None
    assert offers_by_row(None, 2) == [None, None]
    with pytest.raises(WorkloadError, match="3 offers for 4 requests"):
        offers_by_row({**tools, "offers": tools["offers"][:3]}, 4)


SPEC = """name: mine
endpoint: chat
source: {kind: synthetic, input: 8, output: 8}
"""
GOOD_TOOLS = """tools:
  - type: function
    function: {name: f, parameters: {type: object, properties: {a: {type: integer}}}}
  - {name: g}
"""


def test_a_spec_with_tools_offers_them_all_to_every_request(bpe_tokenizer, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(SPEC + GOOD_TOOLS + "tool_choice: g\n")
    built = resolve_workload(path, options=WorkloadOptions(num_requests=3),
                             tokenizer=bpe_tokenizer, use_cache=False)  # fmt: skip
    tools = built.manifest["tools"]
    assert tools["tool_choice"] == "g" and "offers" not in tools
    assert [f["name"] for f in tools["functions"]] == ["f", "g"]
    assert tools["functions"][1]["parameters"] == {"type": "object", "properties": {}}
    rows = offers_by_row(tools, 3)
    assert rows[0].named == "g" and rows[0] is rows[2]


@pytest.mark.parametrize(
    "extra, message",
    [
        (GOOD_TOOLS + "tool_choice: h\n", "mine.yaml:8: tool_choice must be one of auto, required, none or a function of tools (f, g), got 'h'."),
        ("tool_choice: required\n", "mine.yaml:4: tool_choice needs tools"),
        ("tools: []\n", "mine.yaml:4: tools must be a non-empty list"),
        ("tools: [{description: x}]\n", "tools[0] must be a function with a name"),
        ("tools: [{name: f}, {name: f}]\n", "tools must have distinct function names"),
        ("tools: [{name: f, parameters: [1]}]\n", "tools[0].parameters must be a JSON schema"),
        ("tools: [{name: f, parameters: {type: nope}}]\n", "tools[0].parameters is not a valid JSON schema"),
        ("tools: [{name: f, params: {}}]\n", "tools[0] does not take params"),
    ],
)  # fmt: skip
def test_spec_mistakes_are_one_sentence(extra, message):
    with pytest.raises(WorkloadError) as info:
        parse_spec(SPEC + extra, "mine.yaml")
    assert message in str(info.value)
    assert str(info.value).endswith(".") and "\n" not in str(info.value)


def test_tools_need_the_chat_endpoint_and_one_source_of_them():
    completions = SPEC.replace("endpoint: chat", "endpoint: completions")
    with pytest.raises(WorkloadError, match="tools need the chat endpoint"):
        parse_spec(completions + GOOD_TOOLS, "mine.yaml")
    generated = "endpoint: chat\nsource: {kind: tools, output: 64}\n"
    with pytest.raises(WorkloadError, match="the tools source makes the tools"):
        parse_spec(generated + GOOD_TOOLS, "mine.yaml")
    with pytest.raises(WorkloadError, match="one of auto, required, none with generated tools"):
        parse_spec(generated + "tool_choice: f\n", "mine.yaml")
    with pytest.raises(WorkloadError, match="offered: got 5; expected an integer"):
        parse_spec("endpoint: chat\nsource: {kind: tools, output: 8, bank: 4, offered: 5}\n", "m")


def test_an_endpoint_override_away_from_chat_is_refused(bpe_tokenizer):
    with pytest.raises(WorkloadError, match="need the chat endpoint, not completions"):
        resolve_workload("tools", options=WorkloadOptions(num_requests=2, endpoint="completions"),
                         tokenizer=bpe_tokenizer, use_cache=False)  # fmt: skip


def test_the_builtin_tools_entry_is_pinned(bpe_tokenizer):
    """The table's sha256 is pinned in test_pinned_builds; the manifest's tools entry (the
    bank and the per-request offers, which the table does not hold) is pinned here: a change
    is a change to the requests sent. The offers and kinds are written out by hand."""
    tools = _build(bpe_tokenizer, n=6).manifest["tools"]
    assert tools["offers"] == [[11, 9, 6, 3], [0, 5, 9, 4], [8, 6, 1, 0], [2, 9, 5, 11],
                               [3, 7, 2, 10], [1, 5, 10, 7]]  # fmt: skip
    assert tools["parallel"] == [False, True, False, False, True, True]
    assert tools["calls"] == [1, 2, 1, 1, 2, 3]
    digest = hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()
    assert digest == "877893dd2b022f2d5dde7d310bc86d1251a7e0797f2ad1fa5c1185322f5549f4"
