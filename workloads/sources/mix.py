"""The mix source: several synthetic components, each with its own lengths, interleaved by
weight (alternating in exact proportions, or at random)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.schedule import Schedule
from workloads.sources.base import (
    NOWHERE,
    BuildContext,
    Rows,
    at,
    check_length,
    make_source,
    source_keys,
)

INTERLEAVES = ("alternate", "random")


@dataclass(frozen=True)
class MixComponent:
    """One component: its lengths, a name (default `component<k>`) and a weight > 0."""

    name: str
    input: Any
    output: Any
    weight: float = 1

    def __post_init__(self) -> None:
        ys.string(self.name, at("name"))
        check_length(self.input, at("input"))
        check_length(self.output, at("output"))
        ys.number(self.weight, at("weight"), above=0)

    @classmethod
    def from_dict(cls, data: Any, where: Where, index: int) -> MixComponent:
        data = {"name": f"component{index}"} | ys.mapping(data, where)
        names = ("name", "weight", "input", "output")
        return ys.from_mapping(cls, data, where, names, required=("input", "output"))


@dataclass(frozen=True)
class MixSource:
    """`{kind: mix, components: [...], interleave: alternate | random}`."""

    kind: ClassVar[str] = "mix"
    reads_dataset: ClassVar[bool] = False
    default_num_requests: ClassVar[int | None] = 100

    components: tuple[MixComponent, ...]
    interleave: str = "alternate"
    where: Where = field(default=NOWHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.components:
            at("components").fail("no components", "expected a list of at least one")
        ys.enum_member(self.interleave, at("interleave"), INTERLEAVES)

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> MixSource:
        where = at(where)
        given = source_keys(data, where, ("components", "interleave"), required=("components",))
        listed = ys.sequence(given.pop("components"), where / "components", what="a list")
        components = tuple(
            MixComponent.from_dict(c, where / "components" / k, k) for k, c in enumerate(listed)
        )
        return make_source(cls, where, components=components, **given)

    @property
    def takes_prefix(self) -> bool:
        return True

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows:
        times, n = schedule.draw(ctx.rng_arrivals)
        weights = [float(c.weight) for c in self.components]
        which = _interleave(weights, n, self.interleave, ctx.rng_mix)
        ins, outs = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        described = []
        for k, comp in enumerate(self.components):
            mask = which == k
            where = self.where / "components" / k
            ins[mask], outs[mask] = ctx.lengths(int(mask.sum()), comp.input, comp.output, where)
            described.append(
                {
                    "name": comp.name,
                    "weight": comp.weight,
                    "input": ctx.info.pop("input_lengths"),
                    "output": ctx.info.pop("output_lengths"),
                }
            )
        ctx.info["components"] = described
        ctx.info["component_counts"] = {
            c.name: int((which == k).sum()) for k, c in enumerate(self.components)
        }
        return Rows(times, ins, outs, schedule.process.describe())


def _interleave(weights: list[float], n: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    if mode == "random":
        return rng.choice(len(w), size=n, p=w)
    counts = np.zeros(len(w))
    out = np.empty(n, dtype=np.int64)
    for i in range(n):  # smooth weighted round robin: exact proportions, evenly spread
        k = int(np.argmax(w * (i + 1) - counts))
        out[i] = k
        counts[k] += 1
    return out
