"""`Section`: the base of the typed blocks of `summary.json` (see `slo.runrecord.sections`).

A section is a frozen dataclass whose field names are its JSON keys, in the order `slo`'s
writers put them. `from_dict` reads as tolerantly as the readers always did: anything but a
JSON object reads as None (an absent or null block), an absent key as None, and a key the
section does not know is left out. A section read from a document remembers which of its keys
the document had, so `to_dict` writes back exactly what was read: older summaries lack some
keys, and some keys exist only in some runs (`ci` with bootstrap intervals, the saturation
figures once judged, the rates of time slices). A section built in code has every key.
"""

from __future__ import annotations

from dataclasses import Field, field, fields
from typing import Any, Self

_READ = "read"  # field metadata: how the field's JSON value becomes its value
_KIND = "section"  # field metadata: the section class a field holds (alone, listed or keyed)


class Section:
    """Mixin of the summary sections: `from_dict`, `to_dict` and the keys a section has."""

    @classmethod
    def from_dict(cls, data: Any) -> Self | None:
        """The section of the JSON object `data`; None when `data` is not an object."""
        if not isinstance(data, dict):
            return None
        values = read_fields(cls, data)
        section = cls(**values)
        object.__setattr__(section, "_keys", tuple(values))
        return section

    @classmethod
    def empty(cls) -> Self:
        """The section of `{}`: every field None, and no keys (`to_dict()` is `{}`)."""
        return cls.from_dict({})

    @classmethod
    def key_names(cls) -> tuple[str, ...]:
        """The keys the block can have, in writing order (its field names), for the contract."""
        return tuple(f.name for f in fields(cls))

    def json_keys(self) -> tuple[str, ...]:
        """The keys this section has, in writing order: those its document had, else all."""
        read = getattr(self, "_keys", None)
        return read if read is not None else tuple(f.name for f in fields(self))

    def to_dict(self) -> dict:
        """The JSON object: the keys of `json_keys()`, nested sections as their dicts."""
        return {name: plain(getattr(self, name)) for name in self.json_keys()}


def plain(value: Any) -> Any:
    """`value` with every section in it (in lists and dicts too) as its `to_dict()`."""
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def read_fields(cls: type, data: dict) -> dict:
    """`{field: value}` for the fields of the dataclass `cls` that `data` has, in field order,
    each value read as its field says (a section from its dict, and so on)."""
    return {f.name: _read(f, data[f.name]) for f in fields(cls) if f.name in data}


def _read(f: Field, value: Any) -> Any:
    read = f.metadata.get(_READ)
    return value if read is None else read(value)


def section_of(f: Field) -> type[Section] | None:
    """The section class the dataclass field `f` holds, or None for a plain JSON value."""
    return f.metadata.get(_KIND)


def nested(kind: type[Section], *, always: bool = False) -> Any:
    """A field holding one section: None when absent or not an object, or with `always` the
    empty section (a block every summary has)."""
    if not always:
        return field(default=None, metadata={_READ: kind.from_dict, _KIND: kind})

    def read(value: Any) -> Section:
        return kind.from_dict(value) or kind.empty()

    return field(default_factory=kind.empty, metadata={_READ: read, _KIND: kind})


def listed(kind: type[Section]) -> Any:
    """A field holding a list of sections (a value that is not a list reads as None)."""

    def read(value: Any) -> list | None:
        return [kind.from_dict(v) for v in value] if isinstance(value, list) else None

    return field(default=None, metadata={_READ: read, _KIND: kind})


def keyed(kind: type[Section]) -> Any:
    """A field holding `{name: section}` (a value that is not an object reads as None)."""

    def read(value: Any) -> dict | None:
        return {k: kind.from_dict(v) for k, v in value.items()} if isinstance(value, dict) else None

    return field(default=None, metadata={_READ: read, _KIND: kind})
