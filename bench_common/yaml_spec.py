"""YAML specs read one way: a parser that keeps the line of every key, and the small checks
that the spec validators (workload specs, SLO specs, fault plans, gate configurations) share.

Every problem they find is one sentence of one form:

    <origin>:<line>: <where>: <problem>; <what is accepted>.

`origin` names the document (a file path, or a name such as `builtin:chat`), `line` is the
1-based line of the key at fault (known when `load` read the document), `where` is the key path
(`source.components[0].weight`); a part that is unknown is left out, with its colon. E.g.
`plan.yaml:3: windows[0]: unknown key 'fraktion' (did you mean 'fraction'?); known keys: kind,
at, fraction.` or `slo.yaml:4: confidence: got 95; expected a fraction in [0.5, 1).`

A check raises the exception class of its `Where` (`Where.error`), so each package keeps its
own error type and its messages still read alike. A check given a bare key path (a value built
in code, as in a dataclass's `__post_init__`) says only the path; `relocating` puts such an
error, or a message written by other code, under the document it came from.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

import yaml

__all__ = [
    "SpecError",
    "Where",
    "as_where",
    "boolean",
    "describe",
    "document",
    "enum_member",
    "from_mapping",
    "keys",
    "load",
    "load_file",
    "mapping",
    "number",
    "relocating",
    "root",
    "sequence",
    "string",
]


class SpecError(ValueError):
    """A problem in a spec, for callers without an error class of their own; one sentence."""


@dataclass(frozen=True)
class Where:
    """A place in a spec: the document's `origin` (empty when the value was built in code), the
    key `path` to a value (keys and list indexes), the line of every key path `load` saw, and
    the `error` class that a check failing here raises. `where / key` is the place one level
    down; `str(where)` is the message's head, `<origin>:<line>: <path>`."""

    origin: str = ""
    path: tuple[Any, ...] = ()
    lines: Mapping[tuple[Any, ...], int] = field(default_factory=dict, repr=False, compare=False)
    error: type[Exception] = field(default=SpecError, repr=False, compare=False)

    def __truediv__(self, key: Any) -> Where:
        return Where(self.origin, (*self.path, key), self.lines, self.error)

    @property
    def line(self) -> int | None:
        """The line of this key, else of the nearest enclosing one that `load` saw."""
        for end in range(len(self.path), -1, -1):
            line = self.lines.get(self.path[:end])
            if line is not None:
                return line
        return None

    @property
    def key(self) -> str:
        """The key path as written in messages: `source.components[0].input`."""
        text = ""
        for part in self.path:
            if isinstance(part, int) and not isinstance(part, bool):
                text += f"[{part}]"
            else:
                text += f".{part}" if text else str(part)
        return text

    @property
    def place(self) -> str:
        """`<origin>:<line>`, or the origin alone when the line is unknown."""
        line = self.line
        return f"{self.origin}:{line}" if self.origin and line is not None else self.origin

    def __str__(self) -> str:
        return ": ".join(part for part in (self.place, self.key) if part)

    def message(self, problem: str, accepted: str = "", *, at_key: Any = None) -> str:
        """The one-sentence message; `at_key` takes the line from that key inside this place
        (an unknown key is reported on its own line, under its mapping's path)."""
        place = (self / at_key).place if at_key is not None else self.place
        head = ": ".join(part for part in (place, self.key) if part)
        text = f"{head}: {problem}" if head else problem
        if accepted:
            text = f"{text}; {accepted}"
        return text if text.endswith(".") else text + "."

    def fail(self, problem: str, accepted: str = "", *, at_key: Any = None) -> NoReturn:
        """Raise `error` with `message(problem, accepted)`."""
        raise self._error(problem, accepted, at_key)

    def _error(self, problem: str, accepted: str, at_key: Any) -> Exception:
        exc = self.error(self.message(problem, accepted, at_key=at_key))
        exc.spec_problem = _Problem(self, problem, accepted, at_key)  # for `relocating`
        return exc


@dataclass(frozen=True)
class _Problem:
    where: Where
    problem: str
    accepted: str
    at_key: Any


def as_where(where: Where | str, error: type[Exception] = SpecError) -> Where:
    """`where` itself, or for a string the place with that key path and no document."""
    if isinstance(where, Where):
        return where
    return Where(path=(where,) if where else (), error=error)


def root(origin: Where | str, error: type[Exception] = SpecError) -> Where:
    """The root of a document: `origin` itself when it is a `Where` (as `load` gives), else
    the document named `origin`, read without lines (a mapping built in code or from JSON)."""
    return origin if isinstance(origin, Where) else Where(origin, error=error)


@contextmanager
def relocating(where: Where) -> Iterator[None]:
    """Put the `where.error`s raised inside under `where`: a check's problem made at a bare key
    path gets `where`'s document, path and line; another message that does not yet name the
    document gets `<origin>:<line>: ` in front. Problems already placed in a document pass."""
    try:
        yield
    except where.error as exc:
        raise _relocated(exc, where) from None


def _relocated(exc: Exception, where: Where) -> Exception:
    found = getattr(exc, "spec_problem", None)
    if isinstance(found, _Problem):
        if found.where.origin:
            return exc
        inner = Where(where.origin, (*where.path, *found.where.path), where.lines, type(exc))
        return inner._error(found.problem, found.accepted, found.at_key)
    text = str(exc)
    if not where.origin or text.startswith(where.origin):
        return exc
    return type(exc)(f"{where.place}: {text}")


# -- reading ---------------------------------------------------------------------------------


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _LineLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping and records, for every
    mapping and list it builds, the line of each key or item."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.children: dict[int, tuple[Any, dict[Any, int]]] = {}

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:  # as written: before merge keys (<<) are expanded
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            ident = (key_node.tag, key_node.value)
            if ident in first:
                raise _DuplicateKey(
                    problem=f"duplicate key {key_node.value!r} (first on line {first[ident]})",
                    problem_mark=key_node.start_mark,
                )
            first[ident] = key_node.start_mark.line + 1
        return node

    def _map(self, node: yaml.MappingNode) -> Iterator[dict]:
        data: dict = {}
        yield data
        data.update(self.construct_mapping(node))
        lines = {self.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
        self.children[id(data)] = (data, lines)

    def _seq(self, node: yaml.SequenceNode) -> Iterator[list]:
        data: list = []
        yield data
        data.extend(self.construct_sequence(node))
        lines = {i: item.start_mark.line + 1 for i, item in enumerate(node.value)}
        self.children[id(data)] = (data, lines)


_LineLoader.add_constructor("tag:yaml.org,2002:map", _LineLoader._map)
_LineLoader.add_constructor("tag:yaml.org,2002:seq", _LineLoader._seq)


def load(text: str, origin: str, *, error: type[Exception] = SpecError) -> tuple[Any, Where]:
    """Parse YAML `text` as `yaml.safe_load` does (plain dicts, lists and scalars; None for an
    empty document) and return it with the `Where` of its root, which knows every key's line.
    Bad syntax and a key given twice in one mapping raise `error`, naming the line."""
    loader = _LineLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        place = Where(origin, lines={(): mark.line + 1} if mark else {}, error=error)
        if isinstance(exc, _DuplicateKey):
            place.fail(exc.problem, "give each key once")
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        place.fail(f"not valid YAML ({problem})", "fix its syntax")
    finally:
        loader.dispose()
    lines: dict[tuple[Any, ...], int] = {}
    if node is not None:
        lines[()] = node.start_mark.line + 1
        _collect_lines(data, loader.children, lines)
    return data, Where(origin, (), lines, error)


def _collect_lines(root: Any, children: dict, lines: dict[tuple[Any, ...], int]) -> None:
    stack: list[tuple[tuple[Any, ...], Any]] = [((), root)]
    seen: set[int] = set()  # an alias repeats an object: its keys get the first path's lines
    while stack:
        path, value = stack.pop()
        found = children.get(id(value))
        if found is None or id(value) in seen:
            continue
        seen.add(id(value))
        for key, line in found[1].items():
            lines[(*path, key)] = line
            stack.append(((*path, key), value[key]))


def load_file(
    path: Path | str, *, error: type[Exception] = SpecError, what: str = "spec"
) -> tuple[Any, Where]:
    """`load` of the UTF-8 file at `path` (its origin); an unreadable file raises `error`."""
    place = Where(str(path), error=error)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        place.fail(f"cannot read the {what} ({exc.strerror})", "give a readable YAML file")
    except UnicodeDecodeError:
        place.fail(f"the {what} is not UTF-8 text", "give a YAML file")
    return load(text, str(path), error=error)


# -- checks ----------------------------------------------------------------------------------


def describe(value: Any) -> str:
    """A short account of `value` for `got ...`: YAML's words for null and booleans, the
    repr of a scalar (cut at 40 characters), 'a mapping' or 'a list' for containers."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, str | int | float):
        text = repr(value)
        if len(text) <= 40:
            return text
        return text[:36] + "...'" if isinstance(value, str) else text[:37] + "..."
    return f"a {type(value).__name__}"


def _suggestion(given: Any, known: Iterable[Any]) -> str:
    close = difflib.get_close_matches(str(given), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def document(
    data: Any,
    where: Where,
    allowed: Iterable[Any] | None = None,
    required: Iterable[Any] = (),
    *,
    empty: dict | None = None,
) -> dict:
    """The document's root mapping, its keys checked by `keys` when `allowed` is given; an
    empty document is `empty` when given, else an error."""
    if data is None:
        if empty is not None:
            return empty
        where.fail("the document is empty", "expected a mapping")
    if allowed is not None:
        keys(mapping(data, where), where, allowed, required)
    return mapping(data, where)


def mapping(value: Any, where: Where) -> dict:
    """`value` when it is a mapping."""
    if not isinstance(value, dict):
        where.fail(f"got {describe(value)}", "expected a mapping")
    return value


def sequence(value: Any, where: Where, *, what: str = "a list") -> list | tuple:
    """`value` when it is a list (or a tuple, built in code); `what` says which list."""
    if not isinstance(value, list | tuple):
        where.fail(f"got {describe(value)}", f"expected {what}")
    return value


def keys(data: Mapping, where: Where, allowed: Iterable[Any], required: Iterable[Any] = ()) -> None:
    """Every key of `data` is in `allowed` (else the first unknown one, on its own line, with
    the closest known key as a suggestion) and every key of `required` is present."""
    allowed, required = tuple(allowed), tuple(required)
    for key in data:
        if key not in allowed:
            known = ", ".join(str(k) for k in allowed) or "none"
            problem = f"unknown key {key!r}{_suggestion(key, allowed)}"
            where.fail(problem, f"known keys: {known}", at_key=key)
    for key in required:
        if key not in data:
            where.fail(f"missing key {key!r}", f"required keys: {', '.join(map(str, required))}")


def from_mapping(
    cls: type, data: Any, where: Where, allowed: Iterable[Any], required: Iterable[Any] = ()
) -> Any:
    """`cls(**data)` for the mapping `data` at `where`: its keys checked against `allowed` and
    `required` first, then the class's own checks (made at bare key paths, as in a
    `__post_init__`) placed under `where`."""
    keys(mapping(data, where), where, allowed, required)
    with relocating(where):
        return cls(**data)


def _text(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(minimum: Any, maximum: Any, above: Any, below: Any) -> str:
    low = f"[{_text(minimum)}" if minimum is not None else None
    low = f"({_text(above)}" if above is not None else low
    high = f"{_text(maximum)}]" if maximum is not None else None
    high = f"{_text(below)})" if below is not None else high
    if low and high:
        return f"in {low}, {high}"
    if minimum is not None:
        return f">= {_text(minimum)}"
    if above is not None:
        return f"> {_text(above)}"
    if maximum is not None:
        return f"<= {_text(maximum)}"
    return f"< {_text(below)}" if below is not None else ""


def number(
    value: Any,
    where: Where,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    integer: bool = False,
    finite: bool = True,
    what: str | None = None,
    hint: str = "",
) -> Any:
    """`value`, unchanged, when it is a number (never a boolean; with `integer`, an int) that
    is finite unless `finite` is False (NaN never passes) and within the bounds: `minimum` and
    `maximum` inclusive, `above` and `below` exclusive. `what` names the kind of number in the
    message ("a fraction"), `hint` adds an example in brackets."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and integer:
        ok = isinstance(value, int)
    if ok and isinstance(value, float):
        ok = math.isfinite(value) if finite else not math.isnan(value)
    if ok:
        ok = (
            (minimum is None or value >= minimum)
            and (maximum is None or value <= maximum)
            and (above is None or value > above)
            and (below is None or value < below)
        )
    if not ok:
        kind = what or ("an integer" if integer else "a number")
        accepted = " ".join(p for p in (kind, _bounds(minimum, maximum, above, below)) if p)
        where.fail(
            f"got {describe(value)}", f"expected {accepted}" + (f" ({hint})" if hint else "")
        )
    return value


def string(value: Any, where: Where, *, nonempty: bool = False, what: str | None = None) -> str:
    """`value` when it is text (with `nonempty`, not ""); `what` describes it in the message."""
    if not isinstance(value, str) or (nonempty and not value):
        kind = what or ("non-empty text" if nonempty else "text")
        where.fail(f"got {describe(value)}", f"expected {kind}")
    return value


def boolean(value: Any, where: Where) -> bool:
    """`value` when it is true or false (not 0, 1 or "yes" in quotes)."""
    if not isinstance(value, bool):
        where.fail(f"got {describe(value)}", "expected true or false")
    return value


def enum_member(value: Any, where: Where, choices: type[Enum] | Iterable[Any]) -> Any:
    """The member of the Enum `choices` whose value is `value`, or `value` itself when it is one
    of the plain `choices`; else an error listing them (and the closest, when one is close)."""
    if isinstance(choices, type) and issubclass(choices, Enum):
        try:
            return choices(value)
        except (ValueError, TypeError):
            names = [member.value for member in choices]
    else:
        names = list(choices)
        if not isinstance(value, bool) and isinstance(value, str | int | float) and value in names:
            return value
    hint = _suggestion(value, names) if isinstance(value, str) else ""
    where.fail(f"got {describe(value)}{hint}", f"expected one of {', '.join(map(str, names))}")
