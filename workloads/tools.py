"""A workload's tools: the functions each request offers, how it asks the model to use them
(`tool_choice`), and how that reaches the request body and the output check.

In a spec:
  tools        a list of functions, each OpenAI's `{type: function, function: {name,
               description, parameters}}` or the bare `{name, description, parameters}`;
               every request offers all of them. (The `tools` source generates its own bank
               and offers a few per request instead; a spec gives one or the other.)
  tool_choice  auto | required | none | the name of one of the functions (default auto)

On the wire these are OpenAI's chat fields: `tools`, `tool_choice` (a name becomes
`{"type": "function", "function": {"name": ...}}`) and, for a request that says whether it
wants several calls at once (the generated requests do), `parallel_tool_calls`.

The manifest's `tools` entry carries them to the run (as the output `constraint` is carried):
`functions` (bare function objects), `tool_choice`, and, for generated requests, per request
`offers` (indices into `functions`), `parallel` and `calls` (how many calls the prompt asks
for). `offers_by_row` turns that into one shared `ToolOffer` per distinct offer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workloads.schema import WorkloadError

TOOL_CHOICES = ("auto", "required", "none")


@dataclass(frozen=True)
class ToolOffer:
    """What one request offers and asks: bare function objects, the `tool_choice` (one of
    `TOOL_CHOICES` or a function's name) and `parallel` (None: not said)."""

    functions: tuple[dict[str, Any], ...]
    choice: str = "auto"
    parallel: bool | None = None
    by_name: dict[str, dict[str, Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {f["name"]: f for f in self.functions})

    @property
    def named(self) -> str | None:
        """The function the request names in `tool_choice`, or None."""
        return None if self.choice in TOOL_CHOICES else self.choice

    def request_fields(self) -> dict[str, Any]:
        """The chat request body fields that offer the tools."""
        fields: dict[str, Any] = {
            "tools": [{"type": "function", "function": f} for f in self.functions],
            "tool_choice": self.choice
            if self.named is None
            else {"type": "function", "function": {"name": self.named}},
        }
        if self.parallel is not None:
            fields["parallel_tool_calls"] = self.parallel
        return fields


def _fail(origin: str, message: str) -> None:
    raise WorkloadError(f"{origin}: {message}")


def normalise_tools(value: Any, origin: str) -> list[dict[str, Any]]:
    """The spec's `tools` list as bare function objects; WorkloadError naming `origin`
    otherwise (a function needs a unique name; `parameters`, when given, is a JSON schema
    of an object)."""
    if not isinstance(value, list) or not value:
        _fail(origin, "tools must be a non-empty list of functions.")
    functions = []
    for i, item in enumerate(value):
        place = f"tools[{i}]"
        if isinstance(item, dict) and item.get("type") == "function":
            item = item.get("function")
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            _fail(origin, f"{place} must be a function with a name (a non-empty string).")
        unknown = sorted(set(item) - {"name", "description", "parameters", "strict"})
        if unknown:
            _fail(origin, f"{place} does not take {', '.join(unknown)}.")
        parameters = item.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            _fail(origin, f"{place}.parameters must be a JSON schema (a mapping).")
        error = schema_error(parameters)
        if error is not None:
            _fail(origin, f"{place}.parameters is not a valid JSON schema: {error}.")
        functions.append({**item, "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        _fail(origin, "tools must have distinct function names.")
    return functions


def check_tool_choice(value: Any, names: list[str] | None, origin: str) -> str:
    """`value` when it is a tool choice: one of `TOOL_CHOICES`, or one of `names` (None:
    the functions are generated, so no name can be chosen)."""
    if value in TOOL_CHOICES:
        return value
    if names is None:
        _fail(origin, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} with generated tools.")
    if not isinstance(value, str) or value not in names:
        _fail(
            origin,
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function of tools "
            f"({', '.join(names)}), got {value!r}.",
        )
    return value


def _jsonschema() -> Any:
    try:
        import jsonschema
    except ImportError:
        raise WorkloadError(
            "Tools need the jsonschema package to check their parameters and the calls "
            "(pip install jsonschema)."
        ) from None
    return jsonschema


def schema_error(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a valid JSON schema, or None."""
    jsonschema = _jsonschema()
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message
    return None


def arguments_error(schema: dict[str, Any], arguments: Any) -> str | None:
    """Why `arguments` (parsed JSON) do not match the parameters `schema`, or None."""
    jsonschema = _jsonschema()
    errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments)
    error = next(iter(errors), None)
    return None if error is None else error.message


def offers_by_row(tools: dict[str, Any] | None, num_rows: int) -> list[ToolOffer | None]:
    """Each row's `ToolOffer` from the manifest's `tools` entry (None: no tools), one object
    per distinct offer, shared by the rows that make it."""
    if not tools:
        return [None] * num_rows
    functions = tools["functions"]
    choice = tools.get("tool_choice", "auto")
    offers = tools.get("offers")
    parallel = tools.get("parallel")
    if offers is None:
        every = ToolOffer(tuple(functions), choice, None)
        return [every] * num_rows
    if len(offers) != num_rows:
        raise WorkloadError(
            f"The workload's tools list {len(offers)} offers for {num_rows} requests; rebuild it."
        )
    shared: dict[tuple, ToolOffer] = {}
    rows = []
    for k, offer in enumerate(offers):
        wants_parallel = None if parallel is None else bool(parallel[k])
        key = (tuple(offer), wants_parallel)
        if key not in shared:
            shared[key] = ToolOffer(tuple(functions[i] for i in offer), choice, wants_parallel)
        rows.append(shared[key])
    return rows


def tools_from_spec(
    data: dict[str, Any], root: Any, source_kind: str
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The spec's checked `tools` (bare functions; None without) and `tool_choice` (None
    without tools of either kind); `root` is the spec's `Where`, placing the messages. Tools
    need the chat endpoint; a `tools` source makes its own, so a spec gives `tools` only with
    another source."""
    generated = source_kind == "tools"
    given = data.get("tools")
    if generated and given is not None:
        _fail((root / "tools").place, "the tools source makes the tools; drop this list.")
    functions = normalise_tools(given, (root / "tools").place) if given is not None else None
    choice_place = (root / "tool_choice").place
    if functions is None and not generated:
        if data.get("tool_choice") is not None:
            _fail(choice_place, "tool_choice needs tools (a tools list, or the tools source).")
        return None, None
    if data.get("endpoint", "completions") != "chat":
        _fail((root / "endpoint").place, "tools need the chat endpoint; set endpoint: chat.")
    names = None if functions is None else [f["name"] for f in functions]
    choice = check_tool_choice(data.get("tool_choice", "auto"), names, choice_place)
    return functions, choice


def manifest_entry(
    functions: list[dict[str, Any]] | None,
    choice: str | None,
    generated: dict[str, Any] | None,
    endpoint: str,
) -> dict[str, Any] | None:
    """The manifest's `tools` entry: the spec's functions, or a source's generated ones with
    their per-request offers; None without tools. The endpoint a build overrides to must
    still be chat."""
    if choice is None:
        return None
    if endpoint != "chat":
        raise WorkloadError(
            f"This workload offers tools, which need the chat endpoint, not {endpoint}."
        )
    if generated is not None:
        return {"tool_choice": choice, **generated}
    return {"tool_choice": choice, "functions": functions}
