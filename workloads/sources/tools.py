"""The tools source: requests that offer a few functions of a generated bank and ask for one
call (BFCL's `simple`) or two or three at once (`parallel`); see `workloads.tool_bank`.

Its prompts are the requests' own sentences (so its input lengths are theirs); the output
lengths come from `output` (max_tokens: a grammar-constrained call of the bank's bounded
schemas ends well within a few hundred tokens). The bank, each request's offer and kind, and
the number of calls it asks for go to the manifest's `tools` entry (`workloads.tools`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.lengths import Fixed
from workloads.prompts import Prompt, encode_many
from workloads.schedule import Schedule
from workloads.sources.base import NOWHERE, BuildContext, Rows, at, check_length, read_source
from workloads.tool_bank import THEMES, make_bank, make_request

DEFAULT_BANK = 12
DEFAULT_OFFERED = 4
DEFAULT_PARALLEL = 0.5


def tools_rng(seed: int) -> np.random.Generator:
    """The build's seventh seeded stream (`BuildContext` spawns the first four from the same
    seed, `workloads.classes` the fifth), so the bank never shifts arrivals or lengths."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(7)[6])


@dataclass(frozen=True)
class ToolsSource:
    """`{kind: tools, output: <length>, bank: 12, offered: 4, parallel: 0.5}`: a bank of
    `bank` functions, `offered` of them in each request, a `parallel` share of the requests
    asking for two or three calls."""

    kind: ClassVar[str] = "tools"
    reads_dataset: ClassVar[bool] = False
    default_num_requests: ClassVar[int | None] = 100

    output: Any
    bank: int = DEFAULT_BANK
    offered: int = DEFAULT_OFFERED
    parallel: float = DEFAULT_PARALLEL
    where: Where = field(default=NOWHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_length(self.output, at("output"))
        ys.number(self.bank, at("bank"), minimum=1, maximum=len(THEMES), integer=True)
        ys.number(self.offered, at("offered"), minimum=1, maximum=self.bank, integer=True)
        ys.number(self.parallel, at("parallel"), minimum=0, maximum=1)

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> ToolsSource:
        names = ("output", "bank", "offered", "parallel")
        return read_source(cls, data, at(where), names, ("output",))

    @property
    def takes_prefix(self) -> bool:
        return False

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows:
        times, n = schedule.draw(ctx.rng_arrivals)
        rng = tools_rng(ctx.seed)
        bank = make_bank(rng, self.bank)
        parallel = rng.random(n) < self.parallel
        requests = [
            make_request(bank, rng, offered=self.offered, parallel=bool(p)) for p in parallel
        ]
        texts = [r.prompt for r in requests]
        prompts = [
            Prompt(t, np.asarray(ids, dtype=np.int64))
            for t, ids in zip(texts, encode_many(ctx.tokenizer, texts), strict=True)
        ]
        ins = np.asarray([len(p.token_ids) for p in prompts], dtype=np.int64)
        output = ctx.dist(self.output, self.where / "output")
        if ctx.options.output_len is not None:
            output = Fixed(value=ctx.options.output_len)
        outs = output.sample(n, ctx.rng_lengths)
        ctx.info["output_lengths"] = output.describe()
        ctx.info["tools"] = {
            "bank": self.bank,
            "offered": self.offered,
            "parallel_share": self.parallel,
            "parallel_requests": int(parallel.sum()),
        }
        tools = {
            "functions": bank,
            "offers": [list(r.offer) for r in requests],
            "parallel": [r.parallel for r in requests],
            "calls": [len(r.calls) for r in requests],
        }
        return Rows(
            times,
            ins,
            outs,
            schedule.process.describe(),
            prompts=iter([(prompts, None)]),
            source_text="generated tool-calling requests (BFCL simple and parallel shapes)",
            tools=tools,
        )
