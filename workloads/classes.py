"""Request classes: who sends each request (`tenant`), how urgent it is (`priority`, lower
first, vLLM's convention) and by when it must be done (`deadline_ms`, relative to its send).

Three optional top-level keys of a workload spec:

  priority       an integer for every request, or a distribution
  deadline_ms    a positive integer for every request, or a distribution, or null (none)
  tenants        {assign: random | weighted_round_robin, mix: [{name, weight, priority,
                  deadline_ms}, ...]}: requests are shared among the tenants by weight, and
                  a tenant's own priority / deadline_ms replace the workload's for its requests

A distribution is `{values: [...], weights: [...]}` (weights optional, default equal) or,
for deadlines, `{dist: uniform, low: L, high: H}` (integers, both ends included).

Requests of one session (multi-turn) share their first turn's tenant, priority and deadline,
as a user's conversation does. `random` draws each session's tenant by weight;
`weighted_round_robin` deals them in smooth weighted round robin (Nginx's), so the shares are
exact over every window of sum(weights) sessions. Draws come from a fifth seeded stream of the
build (`classes_rng`), so adding classes to a spec leaves its lengths, arrivals and prompts
unchanged. The client sends them as real engines take them: `priority` in the body, the tenant
as OpenAI's `user` field and the deadline as an `x-request-deadline-ms` header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where

CLASS_KEYS = ("priority", "deadline_ms", "tenants")
ASSIGNS = ("random", "weighted_round_robin")
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
MAX_TENANT_CHARS = 256  # as OpenAI's `user` field is taken by the reference engine


@dataclass(frozen=True)
class ValueDist:
    """Integer values with weights (a fixed value is one value of weight 1), or a uniform
    integer range [low, high] (`values` None)."""

    values: tuple[int, ...] | None
    weights: tuple[float, ...] | None = None
    low: int = 0
    high: int = 0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.values is None:
            return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)
        if len(self.values) == 1:
            return np.full(n, self.values[0], dtype=np.int64)
        p = np.asarray(self.weights, float)
        picks = rng.choice(len(self.values), size=n, p=p / p.sum())
        return np.asarray(self.values, dtype=np.int64)[picks]


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float
    priority: ValueDist | None = None
    deadline_ms: ValueDist | None = None


@dataclass(frozen=True)
class RequestClasses:
    """A spec's classes; `sample` gives the three columns."""

    priority: ValueDist | None = None
    deadline_ms: ValueDist | None = None
    tenants: tuple[Tenant, ...] = ()
    assign: str = "random"

    @property
    def empty(self) -> bool:
        return self.priority is None and self.deadline_ms is None and not self.tenants

    def sample(
        self, n: int, rng: np.random.Generator, session_of_row: np.ndarray | None = None
    ) -> ClassColumns:
        """Columns for `n` rows; `session_of_row[i]` numbers row i's session (rows of one
        session share their values), None when every row is its own unit."""
        if session_of_row is None:
            units, inverse = n, np.arange(n)
        else:
            units, inverse = int(session_of_row.max(initial=-1)) + 1, session_of_row
        tenant_idx = self._tenants(units, rng)
        priority = _column(
            units, self.priority, [t.priority for t in self.tenants], tenant_idx, rng
        )
        deadline = _column(
            units, self.deadline_ms, [t.deadline_ms for t in self.tenants], tenant_idx, rng
        )
        names = [t.name for t in self.tenants]
        tenant = None if tenant_idx is None else [names[k] for k in tenant_idx[inverse]]
        return ClassColumns(
            tenant=tenant,
            priority=None if priority is None else priority[inverse],
            deadline_ms=None if deadline is None else deadline[inverse],
        )

    def _tenants(self, units: int, rng: np.random.Generator) -> np.ndarray | None:
        if not self.tenants:
            return None
        weights = np.asarray([t.weight for t in self.tenants], float)
        if self.assign == "random":
            return rng.choice(len(weights), size=units, p=weights / weights.sum())
        return smooth_weighted_round_robin(weights, units)

    def describe(self) -> dict[str, Any]:
        """For the manifest's effective parameters."""
        return {
            "assign": self.assign if self.tenants else None,
            "tenants": [t.name for t in self.tenants],
            "note": "one stream of the build's seed; a session keeps its first turn's values",
        }


@dataclass(frozen=True)
class ClassColumns:
    """Per row: tenant name, priority, deadline in ms (each None when the spec sets none; NaN
    in `priority` or `deadline_ms` is a request without one, from a tenant that set none)."""

    tenant: list[str] | None
    priority: np.ndarray | None
    deadline_ms: np.ndarray | None


def _column(
    units: int,
    default: ValueDist | None,
    per_tenant: list[ValueDist | None],
    tenant_idx: np.ndarray | None,
    rng: np.random.Generator,
) -> np.ndarray | None:
    """One value per unit (float64: int32 values are exact): the tenant's distribution where
    it has one, else the workload's; NaN where neither has (None when nothing sets it)."""
    if default is None and not any(d is not None for d in per_tenant):
        return None
    if tenant_idx is None:
        return default.sample(units, rng).astype(np.float64)  # type: ignore[union-attr]
    out = np.full(units, np.nan)
    for k, dist in enumerate(per_tenant):
        dist = dist if dist is not None else default
        mask = tenant_idx == k
        if dist is not None and mask.any():
            out[mask] = dist.sample(int(mask.sum()), rng)
    return out


def classes_rng(seed: int) -> np.random.Generator:
    """The build's fifth seeded stream (`BuildContext` spawns the first four from the same
    seed), so classes never shift lengths, arrivals or prompts."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])


def smooth_weighted_round_robin(weights: np.ndarray, count: int) -> np.ndarray:
    """`count` picks among len(weights) by smooth weighted round robin: each turn every
    current weight grows by its weight, the largest (first on ties) is picked and loses the
    total. Over any sum(weights) turns (integer weights) each index is picked weight times."""
    current = np.zeros(len(weights))
    total = float(np.sum(weights))
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        current += weights
        k = int(np.argmax(current))
        out[i] = k
        current[k] -= total
    return out


def classes_from_spec(data: dict[str, Any], root: Where) -> RequestClasses:
    """The classes a checked spec mapping sets (its `priority`, `deadline_ms`, `tenants`)."""
    priority = deadline = None
    if data.get("priority") is not None:
        priority = _dist(data["priority"], root / "priority", deadline=False)
    if data.get("deadline_ms") is not None:
        deadline = _dist(data["deadline_ms"], root / "deadline_ms", deadline=True)
    tenants: tuple[Tenant, ...] = ()
    assign = "random"
    if data.get("tenants") is not None:
        where = root / "tenants"
        block = ys.mapping(data["tenants"], where)
        ys.keys(block, where, ("assign", "mix"), required=("mix",))
        assign = ys.enum_member(block.get("assign", "random"), where / "assign", ASSIGNS)
        mix = ys.sequence(block["mix"], where / "mix", what="a list of tenants")
        if not mix:
            (where / "mix").fail("got an empty list", "expected at least one tenant")
        tenants = tuple(_tenant(t, where / "mix" / i) for i, t in enumerate(mix))
        names = [t.name for t in tenants]
        for i, name in enumerate(names):
            if name in names[:i]:
                (where / "mix" / i / "name").fail(
                    f"tenant {name!r} appears twice", "name each tenant once"
                )
    return RequestClasses(priority=priority, deadline_ms=deadline, tenants=tenants, assign=assign)


def _tenant(value: Any, where: Where) -> Tenant:
    t = ys.mapping(value, where)
    ys.keys(t, where, ("name", "weight", "priority", "deadline_ms"), required=("name",))
    name = ys.string(t["name"], where / "name", nonempty=True)
    if len(name) > MAX_TENANT_CHARS:
        (where / "name").fail(f"got {len(name)} characters", f"expected at most {MAX_TENANT_CHARS}")
    weight = ys.number(t.get("weight", 1), where / "weight", above=0)
    priority = deadline = None
    if t.get("priority") is not None:
        priority = _dist(t["priority"], where / "priority", deadline=False)
    if t.get("deadline_ms") is not None:
        deadline = _dist(t["deadline_ms"], where / "deadline_ms", deadline=True)
    return Tenant(name=name, weight=float(weight), priority=priority, deadline_ms=deadline)


def _dist(value: Any, where: Where, *, deadline: bool) -> ValueDist:
    lo, hi = (1, INT32_MAX) if deadline else (INT32_MIN, INT32_MAX)

    def integer(v: Any, at: Where) -> int:
        return int(ys.number(v, at, minimum=lo, maximum=hi, integer=True))

    if not isinstance(value, dict):
        return ValueDist(values=(integer(value, where),))
    if "dist" in value:
        if not deadline:
            (where / "dist").fail("priorities take no dist", "give {values, weights} or an integer")
        ys.keys(value, where, ("dist", "low", "high"), required=("dist", "low", "high"))
        ys.enum_member(value["dist"], where / "dist", ("uniform",))
        low, high = integer(value["low"], where / "low"), integer(value["high"], where / "high")
        if high < low:
            (where / "high").fail(f"got {high} below low {low}", "expected high >= low")
        return ValueDist(values=None, low=low, high=high)
    ys.keys(value, where, ("values", "weights"), required=("values",))
    values = ys.sequence(value["values"], where / "values")
    if not values:
        (where / "values").fail("got an empty list", "expected at least one value")
    ints = tuple(integer(v, where / "values" / i) for i, v in enumerate(values))
    weights = value.get("weights")
    if weights is None:
        return ValueDist(values=ints, weights=(1.0,) * len(ints))
    weights = ys.sequence(weights, where / "weights")
    if len(weights) != len(ints):
        (where / "weights").fail(
            f"got {len(weights)} weights for {len(ints)} values", "expected one weight per value"
        )
    ws = tuple(float(ys.number(w, where / "weights" / i, above=0)) for i, w in enumerate(weights))
    return ValueDist(values=ints, weights=ws)
