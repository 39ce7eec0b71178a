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
        params: {timeout_ms: 100} # per kind, see window.PARAMS (network ones as toxics.py)
    retry: {enabled: false, max_attempts: 3, honour_retry_after: true, statuses: [429, 503],
            backoff_ms: 100, max_backoff_ms: 10000}
    engine_args: [--num-blocks, "48"]  # added to a managed engine's command line for the whole
                                       # run (here a shrunken KV pool, to force preemption)

A window with neither `at` nor `after_requests` starts at 0. Windows are half-open: active from
their start (inclusive) to start + `for` (exclusive). A request-count window is active once
`requests_sent >= after_requests`; its `for` counts from the moment that happened.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import orjson

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from faults.plan_checks import FaultPlanError, at
from faults.retry import RetryPolicy
from faults.window import CLUSTER_KINDS, FaultKind, Layer, Window

# The window types live in faults.window and the retry policy in faults.retry: import them from
# there. FaultPlanError is named here too, for the CLI, which reports it as a user's error.
__all__ = [
    "FaultPlan",
    "FaultPlanError",
    "as_plan",
    "builtin_plan_names",
    "builtin_plan_text",
    "load_plan",
    "parse_plan",
]

_PLAN_KEYS = ("name", "description", "seed", "windows", "retry", "engine_args")
_ARGS = "a list of arguments, e.g. [--num-blocks, '48']"


@dataclass(frozen=True)
class FaultPlan:
    """A named set of fault windows, the client's retry policy, and the arguments a managed
    engine is started with for the whole run (`engine_args`)."""

    name: str
    description: str = ""
    seed: int = 0
    windows: tuple[Window, ...] = ()
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    engine_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ys.string(self.name, at("name"), nonempty=True)
        ys.string(self.description, at("description"))
        ys.number(self.seed, at("seed"), minimum=0, integer=True)
        object.__setattr__(self, "windows", tuple(self.windows))
        for i, w in enumerate(self.windows):
            if not isinstance(w, Window):
                (at("windows") / i).fail(f"got {ys.describe(w)}", "expected a Window")
        if not isinstance(self.retry, RetryPolicy):
            at("retry").fail(f"got {ys.describe(self.retry)}", "expected a RetryPolicy")
        args = ys.sequence(self.engine_args, at("engine_args"), what=_ARGS)
        for i, arg in enumerate(args):
            ys.string(arg, at("engine_args") / i, nonempty=True, what="a non-empty argument")
        object.__setattr__(self, "engine_args", tuple(args))
        if sum(w.kind is FaultKind.SLOW_READER for w in self.windows) > 1:
            at("windows").fail("a plan may have one slow_reader window", "merge the others")

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
        return Layer.ENGINE in self.kinds_by_layer or bool(self.engine_args)

    @property
    def managed_engine_args(self) -> tuple[str, ...]:
        """What a managed engine's command line gets for this plan: `engine_args`, and the
        fault-injection routes when a `slow_steps` or cluster window needs them."""
        admin = any(w.kind is FaultKind.SLOW_STEPS or w.kind in CLUSTER_KINDS for w in self.windows)
        return (*self.engine_args, *(("--enable-fault-injection",) if admin else ()))

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
    def from_dict(cls, data, origin: str | Where = "fault plan") -> FaultPlan:
        """Build from a parsed YAML/JSON mapping (a manifest's copy, or a file's); errors name
        `origin`, with lines when it is the `Where` of `bench_common.yaml_spec.load`."""
        root = ys.root(origin, FaultPlanError)
        data = ys.document(data, root, _PLAN_KEYS, required=("name",))
        windows = ys.sequence(
            data.get("windows") or [], root / "windows", what="a list of fault windows"
        )
        with ys.relocating(root):
            return cls(
                name=data["name"],
                description=data.get("description", ""),
                seed=data.get("seed", 0),
                windows=tuple(
                    Window.from_dict(w, root / "windows" / i) for i, w in enumerate(windows)
                ),
                retry=RetryPolicy.from_dict(data.get("retry") or {}, root / "retry"),
                engine_args=_engine_args(data.get("engine_args"), root / "engine_args"),
            )

    def to_dict(self) -> dict:
        """A plain JSON/YAML-serialisable dict (for the manifest) that `from_dict` reads back."""
        return {
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "windows": [w.to_dict() for w in self.windows],
            "retry": self.retry.to_dict(),
            # Only when set, so that the hashes of plans without it stay as they were.
            **({"engine_args": list(self.engine_args)} if self.engine_args else {}),
        }

    @property
    def sha256(self) -> str:
        """Hex sha256 of the canonical JSON of `to_dict()` (sorted keys, no whitespace)."""
        return hashlib.sha256(orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)).hexdigest()


def _engine_args(value, where: Where) -> tuple[str, ...]:
    """`engine_args` from YAML: a list whose numbers (YAML reads 48 as an int) become text."""
    if value is None:
        return ()
    ys.sequence(value, where, what=_ARGS)
    return tuple(
        str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for v in value
    )


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
    data, root = ys.load(text, origin, error=FaultPlanError)
    return FaultPlan.from_dict(data, root)


def load_plan(name_or_path: str | Path) -> FaultPlan:
    """A plan from a YAML file path, or by built-in name. A path wins when such a file exists;
    an unknown name raises `FaultPlanError` listing the built-ins."""
    path = Path(name_or_path)
    if path.is_file():
        data, root = ys.load_file(path, error=FaultPlanError, what="fault plan")
        return FaultPlan.from_dict(data, root)
    stem = _builtin_stem(str(name_or_path))
    return parse_plan(builtin_plan_text(stem), f"built-in fault plan {stem!r}")


def as_plan(plan: FaultPlan | dict | str | Path) -> FaultPlan:
    """Accept a plan, its dict form (as in manifest.json) or a name/path for `load_plan`."""
    if isinstance(plan, FaultPlan):
        return plan
    if isinstance(plan, dict):
        return FaultPlan.from_dict(plan)
    return load_plan(plan)
