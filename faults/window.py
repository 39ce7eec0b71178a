"""Fault windows: what a fault does (`FaultKind`, at which `Layer`, in which `Direction`, with
which parameters), when it is active (a `Window`, with its YAML durations), and a tracker of
which windows are active as the run goes (`WindowTracker`). The YAML fields are described in
`faults.plan`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from faults.plan_checks import at, is_number

if TYPE_CHECKING:
    from faults.plan import FaultPlan

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}
# What a window's messages say is accepted.
_DURATIONS = "such as 5, 5s, 500ms or 2m"
_POSITIVE_FOR = "expected a duration > 0, or no for to last until the run ends"
_ONE_START = "give either at or after_requests as the start, not both"
_HALF = "0.5 affects half"
_NETWORK_ONLY = "drop it (only network kinds have a direction)"
_WINDOW_KEYS = ("kind", "at", "after_requests", "for", "fraction", "direction", "params")
_WINDOW = at("")  # the window itself, for a problem of no single key


class Layer(StrEnum):
    """Where a fault is injected: the TCP proxy, the client transport, or the managed engine."""

    NETWORK = "network"
    CLIENT = "client"
    ENGINE = "engine"


class Direction(StrEnum):
    """Which way a network fault acts: toward the server, toward the client, or both."""

    UPSTREAM = "upstream"
    DOWNSTREAM = "downstream"
    BOTH = "both"


class FaultKind(StrEnum):
    """What a window does. Network kinds are the proxy's toxics; client kinds are transport
    wrappers (`faults.client`); engine kinds act on a managed engine process."""

    LATENCY = "latency"
    BANDWIDTH = "bandwidth"
    SLICER = "slicer"
    STALL = "stall"
    RESET_PEER = "reset_peer"
    LIMIT_DATA = "limit_data"
    DOWN = "down"
    CANCEL = "cancel"
    DISCONNECT_STORM = "disconnect_storm"
    SLOW_READER = "slow_reader"
    KILL_ENGINE = "kill_engine"
    PAUSE_ENGINE = "pause_engine"
    SLOW_STEPS = "slow_steps"
    KILL_DECODE_WORKER = "kill_decode_worker"
    KILL_PREFILL_WORKER = "kill_prefill_worker"
    CORRUPT_KV = "corrupt_kv"
    CUT_KV_LINK = "cut_kv_link"
    KV_LINK_LATENCY = "kv_link_latency"
    KV_LINK_BANDWIDTH = "kv_link_bandwidth"

    @property
    def layer(self) -> Layer:
        return _LAYERS[self]


_CLIENT = {FaultKind.CANCEL, FaultKind.DISCONNECT_STORM, FaultKind.SLOW_READER}
# Kinds acting on a P/D cluster's workers or KV link (the router's /admin/cluster_fault);
# the kv_link ones are the proxy's toxics on the link (`faults.cluster`).
CLUSTER_KINDS = frozenset(
    {FaultKind.KILL_DECODE_WORKER, FaultKind.KILL_PREFILL_WORKER, FaultKind.CORRUPT_KV,
     FaultKind.CUT_KV_LINK, FaultKind.KV_LINK_LATENCY, FaultKind.KV_LINK_BANDWIDTH}
)  # fmt: skip
_ENGINE = {FaultKind.KILL_ENGINE, FaultKind.PAUSE_ENGINE, FaultKind.SLOW_STEPS, *CLUSTER_KINDS}
# The dashed spellings of the cluster kinds.
_ALIASES = {k.value.replace("_", "-"): k for k in CLUSTER_KINDS}
_LAYERS = {
    k: Layer.CLIENT if k in _CLIENT else Layer.ENGINE if k in _ENGINE else Layer.NETWORK
    for k in FaultKind
}


@dataclass(frozen=True)
class Param:
    """One parameter of a fault kind: a finite number >= `low` (> `low` when `strict`), an
    integer when `integer`; `default` None makes it required unless `optional`."""

    name: str
    default: float | None = None
    low: float = 0.0
    strict: bool = False
    integer: bool = False
    optional: bool = False

    def check(self, value, where: Where) -> float | int:
        """`value` when it is such a number (a float unless `integer`), else an error."""
        low, above = (None, self.low) if self.strict else (self.low, None)
        ys.number(value, where, minimum=low, above=above, integer=self.integer)
        return value if self.integer else float(value)


# Network parameters are those of the proxy's toxics (faults/toxics.py), spelled the same.
_LATENCY = (Param("latency_ms"), Param("jitter_ms", 0.0))
_BANDWIDTH = (Param("rate_kbps", strict=True),)
# A cluster worker by its index in the cluster (as /metrics' `worker` label counts them).
_WORKER = Param("worker", integer=True, optional=True)
PARAMS: dict[FaultKind, tuple[Param, ...]] = {
    FaultKind.LATENCY: _LATENCY,
    FaultKind.BANDWIDTH: _BANDWIDTH,
    FaultKind.SLICER: (
        Param("average_size", low=1.0),
        Param("size_variation", 0.0),
        Param("delay_us", 0.0),
    ),
    FaultKind.STALL: (),
    FaultKind.RESET_PEER: (Param("timeout_ms", 0.0),),
    FaultKind.LIMIT_DATA: (Param("bytes"),),
    FaultKind.DOWN: (Param("reset_open", 1.0),),
    FaultKind.CANCEL: (
        Param("after_tokens", low=1, integer=True, optional=True),
        Param("after_ms", strict=True, optional=True),
    ),
    FaultKind.DISCONNECT_STORM: (Param("min_ms", 0.0), Param("max_ms", 1000.0, strict=True)),
    FaultKind.SLOW_READER: (
        Param("read_delay_ms", strict=True),
        Param("read_bytes", 256, low=1, integer=True),
    ),
    FaultKind.KILL_ENGINE: (Param("restart_delay_ms", 0.0),),
    FaultKind.PAUSE_ENGINE: (),
    FaultKind.SLOW_STEPS: (Param("delay_ms", strict=True),),
    FaultKind.KILL_DECODE_WORKER: (_WORKER,),
    FaultKind.KILL_PREFILL_WORKER: (_WORKER,),
    FaultKind.CORRUPT_KV: (),
    FaultKind.CUT_KV_LINK: (),
    FaultKind.KV_LINK_LATENCY: (*_LATENCY, _WORKER),
    FaultKind.KV_LINK_BANDWIDTH: (*_BANDWIDTH, _WORKER),
}
# Kinds with two parameters where the first must be below the second.
_BELOW = {
    FaultKind.DISCONNECT_STORM: ("min_ms", "max_ms"),
    FaultKind.SLICER: ("size_variation", "average_size"),
}


def parse_seconds(value, where: Where | str) -> float:
    """A duration in seconds from a number of seconds or text such as "5", "5s", "500ms", "2m";
    a negative, infinite or unreadable one is an error at `where`."""
    seconds = None
    if is_number(value):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds is None or not 0 <= seconds < math.inf:
        at(where).fail(f"got {ys.describe(value)}", f"expected a duration >= 0 {_DURATIONS}")
    return seconds


@dataclass(frozen=True)
class Window:
    """One fault, active over a span of the run. Times are seconds from the measured phase's
    start; `params` holds `(name, value)` pairs for every parameter that has a value."""

    kind: FaultKind
    at_s: float | None = None
    after_requests: int | None = None
    for_s: float | None = None
    fraction: float = 1.0
    direction: Direction | None = None
    params: tuple[tuple[str, float | int], ...] = ()

    def __post_init__(self) -> None:
        kind = _ALIASES.get(self.kind, self.kind) if isinstance(self.kind, str) else self.kind
        kind = ys.enum_member(kind, at("kind"), FaultKind)
        object.__setattr__(self, "kind", kind)
        if self.at_s is not None and self.after_requests is not None:
            at("after_requests").fail("given with at", _ONE_START)
        if self.at_s is not None:
            object.__setattr__(self, "at_s", parse_seconds(self.at_s, "at"))
        if self.after_requests is not None:
            ys.number(self.after_requests, at("after_requests"), minimum=0, integer=True)
        elif self.at_s is None:
            object.__setattr__(self, "at_s", 0.0)
        if self.for_s is not None:
            for_s = parse_seconds(self.for_s, "for")
            if for_s == 0:
                at("for").fail(f"got {ys.describe(self.for_s)}", _POSITIVE_FOR)
            object.__setattr__(self, "for_s", for_s)
        self._check_fraction_and_direction(kind)
        object.__setattr__(self, "params", self._checked_params(kind, dict(self.params)))

    def _check_fraction_and_direction(self, kind: FaultKind) -> None:
        fraction = at("fraction")
        f = ys.number(self.fraction, fraction, minimum=0, maximum=1, what="a fraction", hint=_HALF)
        object.__setattr__(self, "fraction", float(f))
        if (kind.layer is Layer.ENGINE or kind is FaultKind.DOWN) and f != 1:
            fraction.fail(f"got {ys.describe(f)}, but {kind} acts on the whole target", "drop it")
        if self.direction is not None and kind.layer is not Layer.NETWORK:
            at("direction").fail(f"given for {kind}, a {kind.layer} kind", _NETWORK_ONLY)
        if kind.layer is Layer.NETWORK:
            d = self.direction if self.direction is not None else Direction.DOWNSTREAM
            object.__setattr__(self, "direction", ys.enum_member(d, at("direction"), Direction))
        if kind is FaultKind.PAUSE_ENGINE and self.for_s is None:
            _WINDOW.fail("missing key 'for'", "pause_engine needs for: how long the engine stops")

    @staticmethod
    def _checked_params(kind: FaultKind, given: dict) -> tuple:
        specs, where = PARAMS[kind], at("params")
        ys.keys(given, where, tuple(p.name for p in specs))
        values = {}
        for p in specs:
            if given.get(p.name) is not None:
                values[p.name] = p.check(given[p.name], where / p.name)
            elif p.default is not None:
                values[p.name] = float(p.default) if not p.integer else p.default
            elif not p.optional:
                where.fail(f"missing key {p.name!r}", f"{kind} needs params.{p.name}")
        if kind is FaultKind.CANCEL and len(values) != 1:
            where.fail(
                f"got {' and '.join(values) or 'neither'}",
                "cancel needs exactly one of params.after_tokens and after_ms",
            )
        if kind in _BELOW:
            low, high = _BELOW[kind]
            if not values[low] < values[high]:
                (where / low).fail(
                    f"got {values[low]:g} with {high} {values[high]:g}",
                    f"{kind} needs params.{low} below {high}",
                )
        if kind is FaultKind.DOWN and values["reset_open"] not in (0, 1):
            (where / "reset_open").fail(
                f"got {ys.describe(given['reset_open'])}", "expected 0 or 1"
            )
        return tuple(values.items())

    @property
    def layer(self) -> Layer:
        return self.kind.layer

    def param(self, name: str, default=None):
        """The value of parameter `name`, or `default` when it has none."""
        return dict(self.params).get(name, default)

    def bounds_s(self, trigger_s: float | None = None) -> tuple[float, float] | None:
        """[start, end) in seconds (end inf: until the run ends). A request-count window starts
        at `trigger_s`, when its `after_requests`-th request went out; None before that."""
        start = self.at_s if self.at_s is not None else trigger_s
        if start is None:
            return None
        return start, (math.inf if self.for_s is None else start + self.for_s)

    def is_active(
        self, elapsed_s: float, requests_sent: int, trigger_s: float | None = None
    ) -> bool:
        """Whether this window is active `elapsed_s` seconds into the run after
        `requests_sent` requests. A request-count window whose trigger time is unknown is
        taken to have fired at `elapsed_s`."""
        if self.after_requests is not None:
            if requests_sent < self.after_requests:
                return False
            trigger_s = elapsed_s if trigger_s is None else trigger_s
        start, end = self.bounds_s(trigger_s)
        return start <= elapsed_s < end

    @classmethod
    def from_dict(cls, data, where: Where | str) -> Window:
        """A window from its mapping as written in a plan; every error, the window's own checks
        included, is placed at `where` (with lines when it is a place in a loaded document)."""
        where = at(where)
        ys.keys(ys.mapping(data, where), where, _WINDOW_KEYS, required=("kind",))
        params = ys.mapping(data.get("params") or {}, where / "params")
        with ys.relocating(where):
            return cls(
                kind=data["kind"],
                at_s=data.get("at"),
                after_requests=data.get("after_requests"),
                for_s=data.get("for"),
                fraction=data.get("fraction", 1.0),
                direction=data.get("direction"),
                params=tuple(params.items()),
            )

    def to_dict(self) -> dict:
        out: dict = {"kind": self.kind.value}
        if self.after_requests is not None:
            out["after_requests"] = self.after_requests
        else:
            out["at"] = self.at_s
        out["for"] = self.for_s
        out["fraction"] = self.fraction
        if self.direction is not None:
            out["direction"] = self.direction.value
        out["params"] = dict(self.params)
        return out


class WindowTracker:
    """Polls a plan's active windows, remembering when each request-count trigger fired (at
    the first poll that saw enough requests, so its accuracy is the polling interval)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.trigger_s: dict[int, float] = {}

    def update(self, elapsed_s: float, requests_sent: int) -> None:
        """Note the triggers that `requests_sent` fires at `elapsed_s`."""
        for i, w in enumerate(self.plan.windows):
            n = w.after_requests
            if n is not None and i not in self.trigger_s and requests_sent >= n:
                self.trigger_s[i] = elapsed_s

    def poll(self, elapsed_s: float, requests_sent: int) -> list[Window]:
        """`update`, then the windows active now."""
        self.update(elapsed_s, requests_sent)
        return self.plan.active_windows(elapsed_s, requests_sent, self.trigger_s)
