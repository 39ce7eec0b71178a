"""The synthetic source: input and output lengths drawn from distributions, prompts synthesised
from the bundled corpus (with the spec's shared prefixes, if any)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from bench_common.yaml_spec import Where
from workloads.schedule import Schedule
from workloads.sources.base import (
    NOWHERE,
    BuildContext,
    Rows,
    at,
    check_length,
    read_source,
)


@dataclass(frozen=True)
class SyntheticSource:
    """`{kind: synthetic, input: <length>, output: <length>}`; a length is a token count or a
    distribution mapping (`workloads.lengths`)."""

    kind: ClassVar[str] = "synthetic"
    reads_dataset: ClassVar[bool] = False
    default_num_requests: ClassVar[int | None] = 100

    input: Any
    output: Any
    where: Where = field(default=NOWHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_length(self.input, at("input"))
        check_length(self.output, at("output"))

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> SyntheticSource:
        return read_source(cls, data, at(where), ("input", "output"), ("input", "output"))

    @property
    def takes_prefix(self) -> bool:
        return True

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows:
        times, n = schedule.draw(ctx.rng_arrivals)
        ins, outs = ctx.lengths(n, self.input, self.output, self.where)
        return Rows(times, ins, outs, schedule.process.describe())
