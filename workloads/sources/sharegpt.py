"""The ShareGPT source: first turns of ShareGPT conversations as prompts and the answers' token
counts as output lengths, sampled under vLLM's rules; without a file, synthetic lengths from
the spec's `fallback` stand in (and the manifest says the workload is synthetic)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.loaders import ShareGPTRules, load_sharegpt
from workloads.prompts import Prompt
from workloads.schedule import Schedule
from workloads.schema import WorkloadError
from workloads.sources.base import (
    NOWHERE,
    BuildContext,
    Rows,
    at,
    check_length,
    make_source,
    source_keys,
)

RULE_KEYS = (
    "min_prompt_tokens",
    "max_prompt_tokens",
    "min_output_tokens",
    "max_total_tokens",
    "shuffle",
)
FALLBACK_TEXT = "synthetic lengths standing in for ShareGPT"


@dataclass(frozen=True)
class ShareGPTFallback:
    """Lengths used when no ShareGPT file is given, and the sentence that says so."""

    input: Any
    output: Any
    description: str | None = None

    def __post_init__(self) -> None:
        check_length(self.input, at("input"))
        check_length(self.output, at("output"))
        if self.description is not None:
            ys.string(self.description, at("description"))

    @classmethod
    def from_dict(cls, data: Any, where: Where) -> ShareGPTFallback:
        names = ("input", "output", "description")
        return ys.from_mapping(cls, data, where, names, required=("input", "output"))


@dataclass(frozen=True)
class ShareGPTSource:
    """`{kind: sharegpt, path, fallback, skip_malformed, <vLLM's rules>}`: `path` (or the
    dataset_path option) names the JSON file; the rules are `ShareGPTRules`' fields."""

    kind: ClassVar[str] = "sharegpt"
    reads_dataset: ClassVar[bool] = True
    default_num_requests: ClassVar[int | None] = 100

    path: str | None = None
    fallback: ShareGPTFallback | None = None
    rules: ShareGPTRules = field(default_factory=ShareGPTRules)
    skip_malformed: bool = False
    where: Where = field(default=NOWHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.path is not None:
            ys.string(self.path, at("path"), what="a ShareGPT JSON file")
        ys.boolean(self.skip_malformed, at("skip_malformed"))

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> ShareGPTSource:
        where = at(where)
        given = source_keys(data, where, ("path", "fallback", "skip_malformed", *RULE_KEYS))
        rules = {k: given.pop(k) for k in RULE_KEYS if k in given}
        for key, value in rules.items():
            if key == "shuffle":
                ys.boolean(value, where / key)
            else:
                ys.number(value, where / key, minimum=1, integer=True)
        if given.get("fallback") is not None:
            given["fallback"] = ShareGPTFallback.from_dict(given["fallback"], where / "fallback")
        with ys.relocating(where):
            rules = ShareGPTRules(**rules)
        return make_source(cls, where, **given, rules=rules)

    @property
    def takes_prefix(self) -> bool:
        return False

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows:
        times, n = schedule.draw(ctx.rng_arrivals)
        arrivals = schedule.process.describe()
        path = ctx.dataset(self.path)
        if path is None:
            if self.fallback is None:
                raise WorkloadError(
                    f"Workload {ctx.name!r} needs dataset_path (a ShareGPT JSON file)."
                )
            fb = self.fallback
            ins, outs = ctx.lengths(n, fb.input, fb.output, self.where / "fallback")
            ctx.info["sharegpt_file"] = None
            text = fb.description if fb.description is not None else FALLBACK_TEXT
            return Rows(times, ins, outs, arrivals, source_text=text)
        if ctx.options.input_len is not None:
            raise WorkloadError(
                "ShareGPT prompts keep their own lengths; drop input_len (output_len may be set)."
            )
        sample = load_sharegpt(
            path,
            tokenizer=ctx.tokenizer,
            num_requests=n,
            seed=ctx.seed,
            rules=self.rules,
            output_len=ctx.options.output_len,
            skip_malformed=self.skip_malformed,
        )
        ctx.info["sharegpt_file"] = {
            "path": str(path),
            "rules": self.rules.__dict__,
            "considered": sample.considered,
            "filtered_out": sample.filtered_out,
            "oversampled": sample.oversampled,
            "skipped_rows": sample.skipped_rows,
        }
        prompts = [
            Prompt(t, np.asarray(ids, dtype=np.int64))
            for t, ids in zip(sample.prompts, sample.prompt_token_ids, strict=True)
        ]
        ins = np.asarray([len(p.token_ids) for p in prompts], dtype=np.int64)
        outs = np.asarray(sample.output_tokens, dtype=np.int64)
        return Rows(
            times,
            ins,
            outs,
            arrivals,
            prompts=iter([(prompts, None)]),
            synthetic=False,
            source_text=f"ShareGPT conversations from {path} (vLLM sampling rules)",
        )
