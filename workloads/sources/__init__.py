"""Workload sources, one module per kind, and `SOURCES`, which maps a spec's `source.kind` to
its class (each follows `workloads.sources.base.Source`)."""

from __future__ import annotations

from typing import Any

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.sources.base import BuildContext, Rows, Source, at
from workloads.sources.mix import MixSource
from workloads.sources.sessions import SessionColumns, SessionsSource
from workloads.sources.sharegpt import ShareGPTSource
from workloads.sources.synthetic import SyntheticSource
from workloads.sources.tools import ToolsSource
from workloads.sources.trace import TraceSource

SOURCES: dict[str, type[Source]] = {
    cls.kind: cls
    for cls in (
        SyntheticSource,
        MixSource,
        ShareGPTSource,
        TraceSource,
        SessionsSource,
        ToolsSource,
    )
}

__all__ = [
    "SOURCES",
    "BuildContext",
    "MixSource",
    "Rows",
    "SessionColumns",
    "SessionsSource",
    "ShareGPTSource",
    "Source",
    "SyntheticSource",
    "ToolsSource",
    "TraceSource",
    "source_from_dict",
]


def source_from_dict(data: Any, where: Where | str) -> Source:
    """The source that the spec's `source` mapping at `where` describes, by its `kind`."""
    where = at(where)
    data = ys.mapping(data, where)
    if "kind" not in data:
        where.fail("missing key 'kind'", f"expected one of {', '.join(SOURCES)}")
    kind = ys.enum_member(data["kind"], where / "kind", tuple(SOURCES))
    return SOURCES[kind].from_dict(data, where)
