"""A generated bank of function schemas and the requests that ask for calls to them, shaped like
BFCL's `simple` (one call) and `parallel` (two or three calls in one answer) categories.

Nothing is downloaded: the bank is built from a fixed list of function themes and a fixed pool of
typed fields, picked and combined by a seeded generator, so one seed always gives the same
functions, offers and prompts. Every parameter schema is bounded (strings by `maxLength`,
integers and numbers by a range, enums and booleans by construction) and closed
(`additionalProperties: false`), so a grammar-constrained answer is short and ends well within
a few hundred tokens, and the five JSON types a tool-calling benchmark should exercise (string,
enum, integer, number, boolean) all occur in every bank.

A prompt names the function and spells out each argument's value, so a capable model can get
the call exactly right; the harness checks only that a call is well formed (valid JSON, an
offered function, schema-valid arguments), not that it is the one the prompt asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

# (name, description): what a function does; its parameters are drawn from FIELDS.
THEMES = (
    ("get_weather", "Get the weather forecast for a place"),
    ("book_flight", "Book a flight"),
    ("convert_currency", "Convert an amount of money between currencies"),
    ("find_restaurants", "Find restaurants near a place"),
    ("send_message", "Send a short message to a contact"),
    ("create_event", "Create a calendar event"),
    ("search_products", "Search the shop's products"),
    ("translate_text", "Translate a short text"),
    ("plan_route", "Plan a route between two places"),
    ("set_alarm", "Set an alarm"),
    ("order_pizza", "Order a pizza for delivery"),
    ("check_stock", "Check how many items are in stock"),
    ("reserve_table", "Reserve a table at a restaurant"),
    ("play_song", "Play a song"),
    ("track_package", "Track a parcel"),
    ("rent_car", "Rent a car"),
    ("get_exchange_rate", "Get the exchange rate of a currency"),
    ("log_workout", "Log a workout"),
)

CITIES = ("Paris", "Lyon", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Austin", "Perth")
WORDS = ("blue", "garden", "river", "quick", "lamp", "violin", "harbor", "maple", "orbit", "salt")
ENUMS = {
    "unit": ("celsius", "fahrenheit"),
    "currency": ("USD", "EUR", "GBP", "JPY"),
    "size": ("small", "medium", "large"),
    "mode": ("walk", "bike", "car", "train"),
    "priority": ("low", "normal", "high"),
}

# name -> its JSON schema; the kind decides how a value is drawn for a prompt.
FIELDS: dict[str, dict[str, Any]] = {
    "city": {"type": "string", "maxLength": 24, "description": "A city name"},
    "destination": {"type": "string", "maxLength": 24, "description": "Where to go"},
    "query": {"type": "string", "maxLength": 32, "description": "Free text"},
    "contact": {"type": "string", "maxLength": 24, "description": "A person's name"},
    "unit": {"type": "string", "enum": list(ENUMS["unit"])},
    "currency": {"type": "string", "enum": list(ENUMS["currency"])},
    "size": {"type": "string", "enum": list(ENUMS["size"])},
    "mode": {"type": "string", "enum": list(ENUMS["mode"])},
    "priority": {"type": "string", "enum": list(ENUMS["priority"])},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "count": {"type": "integer", "minimum": 1, "maximum": 20},
    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    "amount": {"type": "number", "minimum": 0, "maximum": 1000},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "urgent": {"type": "boolean"},
    "notify": {"type": "boolean"},
}
KINDS = ("string", "enum", "integer", "number", "boolean")


def field_kind(schema: dict[str, Any]) -> str:
    return "enum" if "enum" in schema else schema["type"]


@dataclass(frozen=True)
class ToolCall:
    """One call a prompt asks for: the function's index in the bank and its arguments."""

    function: int
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    """One generated request: the offered functions (indices into the bank, in the order
    offered), whether it is a parallel one, the calls its prompt asks for, and the prompt."""

    offer: tuple[int, ...]
    parallel: bool
    calls: tuple[ToolCall, ...]
    prompt: str


def make_bank(rng: np.random.Generator, size: int) -> list[dict[str, Any]]:
    """`size` functions (at most `len(THEMES)`), as bare OpenAI function objects `{name,
    description, parameters}`: each takes one to four fields, at least one required. The
    first five functions take one field of each kind in turn, so every kind occurs."""
    if not 1 <= size <= len(THEMES):
        raise ValueError(f"a bank has 1 to {len(THEMES)} functions, not {size}")
    by_kind = {k: [n for n, s in FIELDS.items() if field_kind(s) == k] for k in KINDS}
    themes = [THEMES[i] for i in rng.permutation(len(THEMES))[:size]]
    bank = []
    for k, (name, description) in enumerate(themes):
        names = list(FIELDS)
        count = int(rng.integers(1, 5))
        picked = [names[i] for i in rng.permutation(len(names))[:count]]
        if k < len(KINDS):  # guarantee this kind's presence
            kind = KINDS[k]
            if not any(field_kind(FIELDS[p]) == kind for p in picked):
                options = by_kind[kind]
                picked[-1] = options[int(rng.integers(len(options)))]
                picked = list(dict.fromkeys(picked))
        n_required = int(rng.integers(1, len(picked) + 1))
        parameters = {
            "type": "object",
            "properties": {p: dict(FIELDS[p]) for p in picked},
            "required": picked[:n_required],
            "additionalProperties": False,
        }
        bank.append({"name": name, "description": description + ".", "parameters": parameters})
    return bank


def draw_value(name: str, schema: dict[str, Any], rng: np.random.Generator) -> Any:
    """A value of field `name` that its schema accepts."""
    kind = field_kind(schema)
    if kind == "enum":
        return schema["enum"][int(rng.integers(len(schema["enum"])))]
    if kind == "integer":
        return int(rng.integers(schema["minimum"], schema["maximum"] + 1))
    if kind == "number":
        return round(float(rng.uniform(schema["minimum"], schema["maximum"])), 2)
    if kind == "boolean":
        return bool(rng.integers(2))
    pool = CITIES if name in ("city", "destination") else WORDS
    return str(pool[int(rng.integers(len(pool)))])


def draw_call(bank: list[dict[str, Any]], function: int, rng: np.random.Generator) -> ToolCall:
    """A call of `bank[function]`: every required argument, each optional one half the time."""
    parameters = bank[function]["parameters"]
    required = set(parameters["required"])
    arguments = {}
    for name, schema in parameters["properties"].items():
        if name in required or rng.integers(2):
            arguments[name] = draw_value(name, schema, rng)
    return ToolCall(function, arguments)


def describe_call(bank: list[dict[str, Any]], call: ToolCall) -> str:
    """The sentence asking for `call`: the function by name, each argument's value as JSON."""
    function = bank[call.function]
    args = ", ".join(f"{k} = {json.dumps(v)}" for k, v in call.arguments.items())
    what = function["description"].rstrip(".").lower()
    return f"{what[0].upper()}{what[1:]} by calling {function['name']} with {args}."


def make_request(
    bank: list[dict[str, Any]], rng: np.random.Generator, *, offered: int, parallel: bool
) -> ToolRequest:
    """One request offering `offered` functions of the bank (all of them when the bank is no
    bigger) and asking for one call, or two or three when `parallel` (of distinct offered
    functions where there are enough, as BFCL's parallel category mixes both)."""
    offered = min(offered, len(bank))
    offer = tuple(int(i) for i in rng.permutation(len(bank))[:offered])
    n_calls = int(rng.integers(2, 4)) if parallel else 1
    picks = rng.permutation(offered)[:n_calls].tolist()
    while len(picks) < n_calls:  # fewer offered functions than calls: repeat one
        picks.append(int(rng.integers(offered)))
    calls = tuple(draw_call(bank, offer[p], rng) for p in picks)
    if parallel:
        steps = " ".join(f"({i + 1}) {describe_call(bank, c)}" for i, c in enumerate(calls))
        prompt = f"Answer with {n_calls} function calls at once, one per task. {steps}"
    else:
        prompt = f"Answer with one function call. {describe_call(bank, calls[0])}"
    return ToolRequest(offer, parallel, calls, prompt)
