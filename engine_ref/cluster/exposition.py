"""The router's /metrics: every worker's Prometheus exposition re-emitted with a
`worker="<index>"` label, plus the router's own families.

Concatenating the workers' texts would not do: the text format wants each family's samples
together under one HELP and one TYPE line. So each text is cut into families (a family begins
at its HELP or TYPE comment; a sample line belongs to the family named last when its name is
that name or extends it, as `_bucket`, `_sum`, `_count` and `_total` do, else it opens an
untyped family of its own), and the families are written once each, in order of first
appearance, their samples worker by worker. Sample lines are otherwise left byte for byte as
the workers wrote them: only the label is inserted, so values and their formatting survive.

Router families (`router_families`): `router_requests_total{worker,policy}` (requests routed
to each worker), `router_inflight{worker}` (in flight at the router now),
`router_worker_up{worker}` (1 while the worker process runs) and
`router_prefix_affinity_fallbacks_total` (prefix-affinity choices given up for the load bound).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_COMMENT = re.compile(r"#\s+(HELP|TYPE)\s+([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\s|$)")


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def with_label(line: str, name: str, value: str) -> str:
    """A sample line with `name="value"` as its first label."""
    match = _NAME.match(line)
    if match is None:
        return line
    metric, rest = match.group(), line[match.end() :]
    label = f'{name}="{value}"'
    if rest.startswith("{}"):
        return f"{metric}{{{label}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{metric}{{{label},{rest[1:]}"
    return f"{metric}{{{label}}}{rest}"


def _families(text: str, worker: str, into: dict[str, _Family]) -> None:
    current: str | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        comment = _COMMENT.match(line)
        if comment is not None:
            kind, current = comment.groups()
            family = into.setdefault(current, _Family())
            if kind == "HELP" and family.help is None:
                family.help = line
            if kind == "TYPE" and family.type is None:
                family.type = line
            continue
        if line.startswith("#"):
            continue
        match = _NAME.match(line)
        if match is None:
            continue
        name = match.group()
        if current is None or not (name == current or name.startswith(current + "_")):
            current = name
        into.setdefault(current, _Family()).samples.append(with_label(line, "worker", worker))


def merge_expositions(texts: Sequence[tuple[str, str]]) -> str:
    """One exposition from `(worker label, exposition text)` pairs."""
    families: dict[str, _Family] = {}
    for worker, text in texts:
        _families(text, worker, families)
    lines = []
    for family in families.values():
        lines += [line for line in (family.help, family.type) if line is not None]
        lines += family.samples
    return "".join(line + "\n" for line in lines)


@dataclass(frozen=True)
class RouterCounts:
    """The router's own figures at scrape time, one entry per worker index."""

    policy: str
    routed: Sequence[int]
    inflight: Sequence[int]
    up: Sequence[bool]
    fallbacks: int


class _RouterCollector:
    def __init__(self, counts: RouterCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self.counts
        routed = CounterMetricFamily(
            "router_requests", "Requests routed to each worker.", labels=["worker", "policy"]
        )
        inflight = GaugeMetricFamily(
            "router_inflight", "Requests in flight at the router, per worker.", labels=["worker"]
        )
        up = GaugeMetricFamily(
            "router_worker_up", "1 while the worker's process runs, else 0.", labels=["worker"]
        )
        for index, (n_routed, n_inflight, is_up) in enumerate(
            zip(c.routed, c.inflight, c.up, strict=True)
        ):
            routed.add_metric([str(index), c.policy], n_routed)
            inflight.add_metric([str(index)], n_inflight)
            up.add_metric([str(index)], 1.0 if is_up else 0.0)
        fallbacks = CounterMetricFamily(
            "router_prefix_affinity_fallbacks",
            "Prefix-affinity choices given up because the worker was over the load bound.",
            value=c.fallbacks,
        )
        yield from (routed, inflight, up, fallbacks)


def router_families(counts: RouterCounts) -> str:
    """The router's own families as exposition text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RouterCollector(counts))
    return generate_latest(registry).decode()
