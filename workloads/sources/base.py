"""What every workload source shares: the `Source` interface, the `Rows` a source decides, the
`BuildContext` it reads and records into while it builds, and the check of a length value."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.assemble import PromptCheck
from workloads.lengths import Fixed, LengthDist, Uniform, length_from_spec, uniform_bounds
from workloads.options import WorkloadOptions
from workloads.prompts import Prompt, PromptSynthesizer
from workloads.schema import WorkloadError

if TYPE_CHECKING:
    from workloads.schedule import Schedule
    from workloads.sources.sessions import SessionColumns

# Prompts in chunks, each with the prefix group of every prompt (None: no groups).
PromptChunks = Iterator[tuple[list[Prompt], list[str | None] | None]]


def at(where: Where | str) -> Where:
    """`where` as a place whose checks raise `WorkloadError` (a string is a bare key path)."""
    return ys.as_where(where, WorkloadError)


NOWHERE = at("")  # the `where` of a source built in code, not read from a spec


def check_length(value: Any, where: Where, *, zero: bool = False) -> Any:
    """`value` when it is a length as a spec writes it: a token count (>= 1; 0 too with `zero`)
    or a mapping with `dist`, which `workloads.lengths.length_from_spec` reads in full when
    the workload is built."""
    if isinstance(value, dict) and "dist" in value:
        return value
    low = 0 if zero else 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        return value
    where.fail(
        f"got {ys.describe(value)}",
        f"expected a token count >= {low} or a mapping such as {{dist: fixed, value: 128}}",
    )


def source_keys(
    data: Any, where: Where, names: tuple[str, ...], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The source mapping's entries but `kind`, after checking that its keys are `kind` and
    `names` and that it has `required`."""
    data = ys.mapping(data, where)
    ys.keys(data, where, ("kind", *names), required=("kind", *required))
    return {k: v for k, v in data.items() if k != "kind"}


def make_source(cls: type, where: Where, **fields: Any) -> Any:
    """`cls(**fields, where=where)`, its own checks' errors placed under `where`."""
    with ys.relocating(where):
        return cls(**fields, where=where)


def read_source(
    cls: type, data: Any, where: Where, names: tuple[str, ...], required: tuple[str, ...] = ()
) -> Any:
    """`cls` from the source mapping `data` at `where` whose keys are `names` (and `kind`)."""
    return make_source(cls, where, **source_keys(data, where, names, required))


@dataclass
class Rows:
    """What a source decided, per request: the arrival offset in seconds (`times`; None for a
    closed loop; NaN for a session's later turns), the input and output token counts (`ins`,
    `outs`), and the prompts, or None to have the builder synthesise them (with the spec's
    shared prefixes). `arrivals` describes the arrival process for the manifest, `streamed`
    prompt chunks are hashed in batches (Mooncake builds), `sessions` holds the session
    columns, `synthetic` and `source_text` say where the requests came from, and `tools` is
    the manifest's tools entry of a source that offers functions per request (`workloads.tools`)."""

    times: np.ndarray | None
    ins: np.ndarray
    outs: np.ndarray
    arrivals: dict[str, Any] | None
    prompts: PromptChunks | None = None
    streamed: bool = False
    sessions: SessionColumns | None = None
    synthetic: bool = True
    source_text: str = ""
    tools: dict[str, Any] | None = None


@dataclass
class BuildContext:
    """What a source reads while it builds, and the build's running record.

    `name` and `base_dir` are the workload's name (for messages) and where its relative paths
    start; `options` are the command line's overrides; `seed` is the option's, else the spec's.
    Four seeded streams, one per concern, keep e.g. a longer arrival schedule from shifting the
    lengths: `rng_lengths`, `rng_arrivals`, `rng_prompts`, `rng_mix`. `check` records what
    prompt verification did and `info` the manifest's effective parameters, in build order.
    """

    name: str
    base_dir: Path | None
    options: WorkloadOptions
    tokenizer: Any
    seed: int
    rng_lengths: np.random.Generator
    rng_arrivals: np.random.Generator
    rng_prompts: np.random.Generator
    rng_mix: np.random.Generator
    check: PromptCheck = field(default_factory=PromptCheck)
    info: dict[str, Any] = field(default_factory=dict)
    synthesizer: PromptSynthesizer | None = None

    @classmethod
    def start(
        cls,
        name: str,
        base_dir: Path | None,
        options: WorkloadOptions,
        tokenizer: Any,
        seed: int,
        synthesizer: PromptSynthesizer | None = None,
    ) -> BuildContext:
        streams = np.random.SeedSequence(seed).spawn(4)
        rngs = [np.random.default_rng(s) for s in streams]
        return cls(name, base_dir, options, tokenizer, seed, *rngs, synthesizer=synthesizer)

    @property
    def synth(self) -> PromptSynthesizer:
        """The prompt synthesiser, built on first use (a trace replayed with its own prompts
        never pays for it)."""
        if self.synthesizer is None:
            self.synthesizer = PromptSynthesizer(self.tokenizer)
        return self.synthesizer

    def dist(self, value: Any, where: Where) -> LengthDist:
        """The length distribution the spec writes at `where`; its errors name that place."""
        with ys.relocating(where):
            return length_from_spec(value, base_dir=self.base_dir, where=str(where))

    def dataset(self, spec_path: str | None) -> Path | None:
        """The dataset file: the dataset_path option, else the spec's path (relative to the
        spec's folder unless it exists as given); None when neither is set."""
        value = self.options.dataset_path or spec_path
        if value is None:
            return None
        p = Path(value)
        if p.is_absolute() or self.base_dir is None or p.exists():
            return p
        return self.base_dir / p

    def lengths(
        self, n: int, input_spec: Any, output_spec: Any, where: Where
    ) -> tuple[np.ndarray, np.ndarray]:
        """`n` input and output token counts from the spec's lengths at `where` (`input`,
        `output`) as the input_len, output_len and range_ratio options change them; both
        distributions go into `info`."""
        opts = self.options
        d_in = _override(self.dist(input_spec, where / "input"), opts.input_len, opts.range_ratio)
        d_out = _override(
            self.dist(output_spec, where / "output"), opts.output_len, opts.range_ratio
        )
        self.info["input_lengths"], self.info["output_lengths"] = d_in.describe(), d_out.describe()
        return d_in.sample(n, self.rng_lengths), d_out.sample(n, self.rng_lengths)


def _override(dist: LengthDist, value: int | None, ratio: float | None) -> LengthDist:
    if value is not None:
        if ratio:
            low, high = uniform_bounds(value, ratio)
            return Uniform(low=low, high=high)
        return Fixed(value=value)
    if ratio is not None:
        if not isinstance(dist, Fixed):
            raise WorkloadError(
                "range_ratio applies to fixed lengths; also give input_len/output_len."
            )
        low, high = uniform_bounds(dist.value, ratio)
        return Uniform(low=low, high=high, min=dist.min, max=dist.max)
    return dist


class Source(Protocol):
    """One kind of workload source: a frozen dataclass whose fields are the spec's `source`
    keys, checked when it is made (`from_dict` adds the key checks and the lines).

    - `kind`: the `source.kind` it is registered under (`workloads.sources.SOURCES`);
    - `reads_dataset`: whether the dataset_path option applies;
    - `default_num_requests`: requests when the spec gives neither num_requests nor a
      duration (None: all the dataset's rows);
    - `takes_prefix`: whether the spec's shared prefixes apply to its prompts;
    - `rows(ctx, schedule)`: the requests' times, lengths and prompts; it records what it
      did in `ctx.info` and raises `WorkloadError` for a problem a user can fix.
    """

    kind: ClassVar[str]
    reads_dataset: ClassVar[bool]
    default_num_requests: ClassVar[int | None]
    where: Where

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> Self: ...

    @property
    def takes_prefix(self) -> bool: ...

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows: ...
