"""Fault plans: frozen dataclasses read from YAML, schema-checked with one-sentence errors.

YAML fields (only `name` is required):

    name: reset-storm
    description: ...
    seed: 0                       # picks which requests a fraction affects, and cut points
    windows:
      - kind: reset_peer          # see FaultKind (network, client and engine kinds)
        at: 5s                    # start, from the start of the measured phase: 5, "5s", "500ms"
        # after_requests: 20      # or: start once 20 requests were sent (not both)
        for: 10s                  # duration; omitted: until the run ends
        fraction: 0.5             # of connections (network) or requests (client); default 1
        direction: downstream     # network kinds only: upstream | downstream (default) | both
        params: {timeout_ms: 100} # per kind, see PARAMS (network ones as faults/toxics.py)
    retry: {enabled: false, max_attempts: 3, honour_retry_after: true, statuses: [429, 503],
            backoff_ms: 100, max_backoff_ms: 10000}

A window with neither `at` nor `after_requests` starts at 0. Windows are half-open: active from
their start (inclusive) to start + `for` (exclusive). A request-count window is active once
`requests_sent >= after_requests`; its `for` counts from the moment that happened.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path

import orjson
import yaml


class FaultPlanError(Exception):
    """A bad fault plan or an unknown built-in name; the message is one sentence naming the fix."""


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

    @property
    def layer(self) -> Layer:
        return _LAYERS[self]


_CLIENT = {FaultKind.CANCEL, FaultKind.DISCONNECT_STORM, FaultKind.SLOW_READER}
_ENGINE = {FaultKind.KILL_ENGINE, FaultKind.PAUSE_ENGINE, FaultKind.SLOW_STEPS}
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


# Network parameters are those of the proxy's toxics (faults/toxics.py), spelled the same.
PARAMS: dict[FaultKind, tuple[Param, ...]] = {
    FaultKind.LATENCY: (Param("latency_ms"), Param("jitter_ms", 0.0)),
    FaultKind.BANDWIDTH: (Param("rate_kbps", strict=True),),
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
}

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}
_WINDOW_KEYS = ("kind", "at", "after_requests", "for", "fraction", "direction", "params")
_PLAN_KEYS = ("name", "description", "seed", "windows", "retry")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_seconds(value, where: str) -> float:
    """A duration in seconds from a number of seconds or text such as "5", "5s", "500ms", "2m"."""
    if _is_number(value):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    elif isinstance(value, str) and value.strip().startswith("-"):
        raise FaultPlanError(f"{where} must not be negative, not {value!r}.")
    else:
        raise FaultPlanError(f"{where} must be a duration such as 5, 5s or 500ms, not {value!r}.")
    if seconds < 0:
        raise FaultPlanError(f"{where} must not be negative, not {value!r}.")
    return seconds


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise FaultPlanError(f"{where} must be a mapping, not {type(value).__name__}.")
    return value


def _check_keys(data: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        known_text = ", ".join(known) if known else "none"
        raise FaultPlanError(
            f"{where} has unknown field {unknown[0]!r}; known fields: {known_text}."
        )


def _member(enum: type[StrEnum], value, where: str):
    try:
        return enum(value)
    except (ValueError, TypeError):
        known = ", ".join(m.value for m in enum)
        raise FaultPlanError(f"{where} {value!r} is unknown; known: {known}.") from None


def _check_param(param: Param, value, where: str) -> float | int:
    bound = f"{'>' if param.strict else '>='} {param.low:g}"
    if param.integer:
        if isinstance(value, bool) or not isinstance(value, int) or value < param.low:
            raise FaultPlanError(f"{where} must be an integer {bound}, not {value!r}.")
        return value
    if not _is_number(value) or value < param.low or (param.strict and value == param.low):
        raise FaultPlanError(f"{where} must be a finite number {bound}, not {value!r}.")
    return float(value)


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
        kind = _member(FaultKind, self.kind, "kind")
        object.__setattr__(self, "kind", kind)
        if self.at_s is not None and self.after_requests is not None:
            raise FaultPlanError("give either at or after_requests as the start, not both.")
        if self.at_s is not None:
            object.__setattr__(self, "at_s", parse_seconds(self.at_s, "at"))
        n = self.after_requests
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise FaultPlanError(f"after_requests must be an integer >= 0, not {n!r}.")
        if self.at_s is None and n is None:
            object.__setattr__(self, "at_s", 0.0)
        if self.for_s is not None:
            for_s = parse_seconds(self.for_s, "for")
            if for_s == 0:
                raise FaultPlanError("for must be positive; leave it out to last until the end.")
            object.__setattr__(self, "for_s", for_s)
        self._check_fraction_and_direction(kind)
        object.__setattr__(self, "params", self._checked_params(kind, dict(self.params)))

    def _check_fraction_and_direction(self, kind: FaultKind) -> None:
        f = self.fraction
        if not _is_number(f) or not 0 <= f <= 1:
            raise FaultPlanError(f"fraction must be in [0, 1] (0.5 affects half), not {f!r}.")
        object.__setattr__(self, "fraction", float(f))
        if (kind.layer is Layer.ENGINE or kind is FaultKind.DOWN) and f != 1:
            raise FaultPlanError(f"{kind} acts on the whole target; drop fraction.")
        if self.direction is not None and kind.layer is not Layer.NETWORK:
            raise FaultPlanError(f"direction applies to network kinds only; drop it from {kind}.")
        if kind.layer is Layer.NETWORK:
            d = self.direction if self.direction is not None else Direction.DOWNSTREAM
            object.__setattr__(self, "direction", _member(Direction, d, "direction"))
        if kind is FaultKind.PAUSE_ENGINE and self.for_s is None:
            raise FaultPlanError("pause_engine needs for (how long the engine stays stopped).")

    @staticmethod
    def _checked_params(kind: FaultKind, given: dict) -> tuple:
        specs = PARAMS[kind]
        _check_keys(given, tuple(p.name for p in specs), f"params of {kind}")
        values = {}
        for p in specs:
            if p.name in given and given[p.name] is not None:
                values[p.name] = _check_param(p, given[p.name], f"params.{p.name}")
            elif p.default is not None:
                values[p.name] = float(p.default) if not p.integer else p.default
            elif not p.optional:
                raise FaultPlanError(f"{kind} needs params.{p.name}.")
        if kind is FaultKind.CANCEL and len(values) != 1:
            raise FaultPlanError("cancel needs exactly one of params.after_tokens or after_ms.")
        if kind is FaultKind.DISCONNECT_STORM and not values["min_ms"] < values["max_ms"]:
            raise FaultPlanError("disconnect_storm needs params.min_ms below max_ms.")
        if kind is FaultKind.SLICER and not values["size_variation"] < values["average_size"]:
            raise FaultPlanError("slicer needs params.size_variation below average_size.")
        if kind is FaultKind.DOWN and values["reset_open"] not in (0.0, 1.0):
            raise FaultPlanError("down's params.reset_open must be 0 or 1.")
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
    def from_dict(cls, data, where: str) -> Window:
        data = _mapping(data, where)
        _check_keys(data, _WINDOW_KEYS, where)
        if "kind" not in data:
            raise FaultPlanError(f"{where} is missing 'kind'.")
        try:
            return cls(
                kind=data["kind"],
                at_s=data.get("at"),
                after_requests=data.get("after_requests"),
                for_s=data.get("for"),
                fraction=data.get("fraction", 1.0),
                direction=data.get("direction"),
                params=tuple(_mapping(data.get("params") or {}, "params").items()),
            )
        except FaultPlanError as exc:
            raise FaultPlanError(f"{where}: {exc}") from None

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


def _default_statuses() -> tuple[int, ...]:
    return (429, 503)


@dataclass(frozen=True)
class RetryPolicy:
    """Client retries of answers whose HTTP status is in `statuses`; off unless `enabled`.

    The wait before retry n (1-based) is the answer's Retry-After when `honour_retry_after` and
    the header is present, else `backoff_ms * 2**(n-1)`; either is capped at `max_backoff_ms`.
    """

    enabled: bool = False
    max_attempts: int = 3
    honour_retry_after: bool = True
    statuses: tuple[int, ...] = field(default_factory=_default_statuses)
    backoff_ms: float = 100.0
    max_backoff_ms: float = 10_000.0

    def __post_init__(self) -> None:
        for key in ("enabled", "honour_retry_after"):
            if not isinstance(getattr(self, key), bool):
                raise FaultPlanError(f"retry.{key} must be true or false.")
        n = self.max_attempts
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise FaultPlanError(f"retry.max_attempts must be an integer >= 1, not {n!r}.")
        statuses = self.statuses
        if not isinstance(statuses, list | tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 400 <= s <= 599 for s in statuses
        ):
            raise FaultPlanError(
                f"retry.statuses must be HTTP error codes such as [429, 503], not {statuses!r}."
            )
        object.__setattr__(self, "statuses", tuple(statuses))
        for key in ("backoff_ms", "max_backoff_ms"):
            v = getattr(self, key)
            if not _is_number(v) or v <= 0:
                raise FaultPlanError(f"retry.{key} must be a positive number, not {v!r}.")
            object.__setattr__(self, key, float(v))
        if self.max_backoff_ms < self.backoff_ms:
            raise FaultPlanError("retry.max_backoff_ms must be at least retry.backoff_ms.")

    def wait_s(self, retry: int, retry_after_s: float | None) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        cap_s = self.max_backoff_ms / 1e3
        if self.honour_retry_after and retry_after_s is not None:
            return min(max(retry_after_s, 0.0), cap_s)
        return min(self.backoff_ms / 1e3 * 2 ** (retry - 1), cap_s)

    @classmethod
    def from_dict(cls, data, where: str = "retry") -> RetryPolicy:
        data = _mapping(data, where)
        _check_keys(data, tuple(cls.__dataclass_fields__), where)
        return cls(**data)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {
            "statuses": list(self.statuses)
        }


@dataclass(frozen=True)
class FaultPlan:
    """A named set of fault windows and the client's retry policy."""

    name: str
    description: str = ""
    seed: int = 0
    windows: tuple[Window, ...] = ()
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FaultPlanError("a fault plan needs a non-empty name.")
        if not isinstance(self.description, str):
            raise FaultPlanError("description must be text.")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise FaultPlanError(f"seed must be an integer >= 0, not {s!r}.")
        object.__setattr__(self, "windows", tuple(self.windows))
        if not all(isinstance(w, Window) for w in self.windows):
            raise FaultPlanError("windows must be Window entries.")
        if not isinstance(self.retry, RetryPolicy):
            raise FaultPlanError("retry must be a RetryPolicy.")
        if sum(w.kind is FaultKind.SLOW_READER for w in self.windows) > 1:
            raise FaultPlanError("a plan may have one slow_reader window; merge the others.")

    @property
    def kinds_by_layer(self) -> dict[Layer, tuple[FaultKind, ...]]:
        """The kinds the plan uses, per layer that it uses, in window order without repeats."""
        out: dict[Layer, tuple[FaultKind, ...]] = {}
        for w in self.windows:
            if w.kind not in out.get(w.layer, ()):
                out[w.layer] = (*out.get(w.layer, ()), w.kind)
        return out

    @property
    def needs_proxy(self) -> bool:
        return Layer.NETWORK in self.kinds_by_layer

    @property
    def needs_managed_engine(self) -> bool:
        return Layer.ENGINE in self.kinds_by_layer

    @property
    def has_client_faults(self) -> bool:
        return Layer.CLIENT in self.kinds_by_layer or self.retry.enabled

    def window_bounds(
        self, trigger_s: Mapping[int, float] | None = None
    ) -> list[tuple[float, float] | None]:
        """Each window's [start, end) in seconds; `trigger_s` maps a request-count window's
        index to the time its trigger fired (None for one that has not fired)."""
        trigger_s = trigger_s or {}
        return [w.bounds_s(trigger_s.get(i)) for i, w in enumerate(self.windows)]

    def active_windows(
        self,
        elapsed_s: float,
        requests_sent: int,
        trigger_s: Mapping[int, float] | None = None,
    ) -> list[Window]:
        """The windows active `elapsed_s` into the run after `requests_sent` requests (pure;
        see `Window.is_active`; `trigger_s` as for `window_bounds`)."""
        trigger_s = trigger_s or {}
        return [
            w
            for i, w in enumerate(self.windows)
            if w.is_active(elapsed_s, requests_sent, trigger_s.get(i))
        ]

    @classmethod
    def from_dict(cls, data, origin: str = "fault plan") -> FaultPlan:
        """Build from a parsed YAML/JSON mapping; `origin` names it in error messages."""
        data = _mapping(data, origin)
        try:
            _check_keys(data, _PLAN_KEYS, origin)
            if "name" not in data:
                raise FaultPlanError(f"{origin} is missing 'name'.")
            windows = data.get("windows") or []
            if not isinstance(windows, list):
                raise FaultPlanError("windows must be a list of fault windows.")
            return cls(
                name=data["name"],
                description=data.get("description", ""),
                seed=data.get("seed", 0),
                windows=tuple(Window.from_dict(w, f"windows[{i}]") for i, w in enumerate(windows)),
                retry=RetryPolicy.from_dict(data.get("retry") or {}),
            )
        except FaultPlanError as exc:
            if str(exc).startswith(origin):
                raise
            raise FaultPlanError(f"{origin}: {exc}") from None

    def to_dict(self) -> dict:
        """A plain JSON/YAML-serialisable dict (for the manifest) that `from_dict` reads back."""
        return {
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "windows": [w.to_dict() for w in self.windows],
            "retry": self.retry.to_dict(),
        }

    @property
    def sha256(self) -> str:
        """Hex sha256 of the canonical JSON of `to_dict()` (sorted keys, no whitespace)."""
        return hashlib.sha256(orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)).hexdigest()


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


def builtin_plan_names() -> list[str]:
    """Names of the fault plans shipped in faults/builtin/ (without the .yaml suffix)."""
    root = resources.files("faults.builtin")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _builtin_stem(name: str) -> str:
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    known = builtin_plan_names()
    if stem not in known:
        raise FaultPlanError(
            f"no fault plan file or built-in named {name!r}; built-ins: {', '.join(known)}."
        )
    return stem


def builtin_plan_text(name: str) -> str:
    """The YAML source of a built-in plan (`reset-storm` or `reset-storm.yaml`)."""
    stem = _builtin_stem(name)
    return resources.files("faults.builtin").joinpath(f"{stem}.yaml").read_text(encoding="utf-8")


def parse_plan(text: str, origin: str) -> FaultPlan:
    """A plan from YAML text; `origin` names it in error messages."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise FaultPlanError(f"{origin} is not valid YAML{at}; fix its syntax.") from None
    return FaultPlan.from_dict(data, origin)


def load_plan(name_or_path: str | Path) -> FaultPlan:
    """A plan from a YAML file path, or by built-in name. A path wins when such a file exists;
    an unknown name raises `FaultPlanError` listing the built-ins."""
    path = Path(name_or_path)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise FaultPlanError(f"cannot read fault plan {path} ({exc.strerror}).") from None
        return parse_plan(text, str(path))
    stem = _builtin_stem(str(name_or_path))
    return parse_plan(builtin_plan_text(stem), f"built-in fault plan {stem!r}")


def as_plan(plan: FaultPlan | dict | str | Path) -> FaultPlan:
    """Accept a plan, its dict form (as in manifest.json) or a name/path for `load_plan`."""
    if isinstance(plan, FaultPlan):
        return plan
    if isinstance(plan, dict):
        return FaultPlan.from_dict(plan)
    return load_plan(plan)
