"""The trace source: recorded requests (Azure, BurstGPT or Mooncake) replayed at their own
timestamps or at the spec's arrival process, prompts synthesised to their token counts.

A Mooncake trace gives every request the hash ids of its 512-token blocks; its prompts are
built from those blocks (`workloads.blocks`), `BLOCK_CHUNK_ROWS` at a time, so that a
trace-scale build is hashed and written in bounded memory."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads import arrivals as arr
from workloads.assemble import FULL_CHECK_TOKENS
from workloads.blocks import MOONCAKE_BLOCK_TOKENS, BlockSynthesizer, block_reuse_from_ids
from workloads.loaders import TRACE_FORMATS, load_trace
from workloads.prompts import Prompt, verify_prompts
from workloads.schedule import Schedule
from workloads.schema import WorkloadError
from workloads.sources.base import NOWHERE, BuildContext, Rows, at, read_source

BLOCK_CHUNK_ROWS = 256  # Mooncake rows built, verified and written at a time
SAMPLES = ("sequential", "bootstrap")


@dataclass(frozen=True)
class TraceSource:
    """`{kind: trace, format, path, skip_malformed, sample, model, log_type}`: `sample` says
    how rows are reused under a spec's own arrival process (in order, or drawn with
    replacement); `model` and `log_type` filter BurstGPT rows."""

    kind: ClassVar[str] = "trace"
    reads_dataset: ClassVar[bool] = True
    default_num_requests: ClassVar[int | None] = None

    format: str
    path: str | None = None
    skip_malformed: bool = False
    sample: str = "sequential"
    model: str | None = None
    log_type: str | None = None
    where: Where = field(default=NOWHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        ys.enum_member(self.format, at("format"), TRACE_FORMATS)
        for key in ("path", "model", "log_type"):
            if getattr(self, key) is not None:
                ys.string(getattr(self, key), at(key))
        ys.boolean(self.skip_malformed, at("skip_malformed"))
        ys.enum_member(self.sample, at("sample"), SAMPLES)

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> TraceSource:
        names = ("format", "path", "skip_malformed", "sample", "model", "log_type")
        return read_source(cls, data, at(where), names, required=("format",))

    @property
    def takes_prefix(self) -> bool:
        return self.format != "mooncake"

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows:
        path = ctx.dataset(self.path)
        if path is None:
            raise WorkloadError(
                f"Workload {ctx.name!r} needs dataset_path (a {self.format} trace file)."
            )
        if ctx.options.input_len is not None:
            raise WorkloadError(
                "Trace requests keep their recorded prompt lengths; drop input_len."
            )
        rec = load_trace(
            self.format,
            path,
            skip_malformed=self.skip_malformed,
            model=self.model,
            log_type=self.log_type,
        )
        if len(rec) == 0:
            raise WorkloadError(f"Trace {path} holds no usable request.")
        ctx.info["trace"] = {
            "format": self.format,
            "path": str(path),
            "rows": len(rec),
            "skipped_rows": rec.skipped_rows,
            "dropped_failed": rec.dropped_failed,
            "filtered_rows": rec.filtered_rows,
        }
        if schedule.process is None:  # recorded timestamps, rows in time order
            replay = arr.TraceTimes(
                timestamps_s=tuple(rec.timestamps_s.tolist()),
                speedup=schedule.speedup,
                jitter_s=schedule.jitter_s,
                source=str(path),
            )
            arrivals = replay.describe()
            all_times = replay.times(None, None, ctx.rng_arrivals)
            keep = np.argsort(all_times, kind="stable")
            if schedule.duration_s is not None:
                keep = keep[all_times[keep] <= schedule.duration_s]
            if schedule.num_requests is not None:
                keep = keep[: schedule.num_requests]
            times = all_times[keep]
        else:
            arrivals = schedule.process.describe()
            n = schedule.num_requests if schedule.num_requests is not None else len(rec)
            times = schedule.process.times(n, schedule.duration_s, ctx.rng_arrivals)
            count = len(times) if times is not None else n
            if self.sample == "bootstrap":
                keep = ctx.rng_lengths.integers(0, len(rec), size=count)
            else:
                keep = np.arange(count) % len(rec)
        ins = rec.input_tokens[keep].astype(np.int64)
        outs = rec.output_tokens[keep].astype(np.int64)
        if ctx.options.output_len is not None:
            outs = np.full(len(keep), ctx.options.output_len, dtype=np.int64)
        text = f"{self.format} trace {path} (recorded token counts; prompts synthesised)"
        if rec.hash_ids is None:
            return Rows(times, ins, outs, arrivals, synthetic=False, source_text=text)
        hashes = [rec.hash_ids[int(i)] for i in keep]
        chunks = block_batches(ctx, hashes, ins)
        return Rows(
            times, ins, outs, arrivals, chunks, streamed=True, synthetic=False, source_text=text
        )


def block_batches(
    ctx: BuildContext, hashes: list[list[int]], ins: np.ndarray
) -> Iterator[tuple[list[Prompt], list[str]]]:
    """Mooncake prompts, `BLOCK_CHUNK_ROWS` at a time (see `workloads.blocks`), verified
    as they go: all of them up to `FULL_CHECK_TOKENS` prompt tokens, else a seeded sample
    of each chunk holding its share of `FULL_CHECK_TOKENS` (the cost of checking is bounded
    by tokens, not prompts), and every later prompt once a sampled one fails."""
    check = ctx.check
    distinct = len({h for ids in hashes for h in ids})
    blocks = BlockSynthesizer(ctx.synth, distinct)
    total = int(ins.sum())
    check.mode = "sample" if total > FULL_CHECK_TOKENS else "all"
    share = min(1.0, FULL_CHECK_TOKENS / max(total, 1))
    for start in range(0, len(hashes), BLOCK_CHUNK_ROWS):
        part = hashes[start : start + BLOCK_CHUNK_ROWS]
        prompts = blocks.prompts(ins[start : start + len(part)], part, ctx.rng_prompts)
        everything = list(range(len(prompts)))
        idx = everything
        if check.mode == "sample":
            size = min(len(prompts), math.ceil(len(prompts) * share))
            idx = sorted(ctx.rng_prompts.choice(len(prompts), size=size, replace=False).tolist())
        bad = _verify_blocks(ctx, prompts, idx)
        if bad and len(idx) < len(prompts):
            check.mode = "all (a sampled prompt failed)"
            bad += _verify_blocks(ctx, prompts, sorted(set(everything) - set(idx)))
        check.mismatched += len(bad)
        yield prompts, [f"hash-{ids[0]}" for ids in part]
    if check.mismatched:
        check.notes.append(
            f"{check.mismatched} block prompt(s) do not re-tokenise to their ids; their ids are kept."
        )
    ctx.info["blocks"] = {
        "block_tokens": MOONCAKE_BLOCK_TOKENS,
        "distinct_hash_ids": distinct,
        "distinct_blocks": blocks.num_blocks,
        "tag_words": blocks.tag_len,
        "infinite_cache_block_hits": block_reuse_from_ids(hashes, ins.tolist()),
        "note": "distinct hash ids give distinct token blocks (a tag of one-token words "
        "spelling the id's index starts every block)",
    }


def _verify_blocks(ctx: BuildContext, prompts: list[Prompt], idx: list[int]) -> list[int]:
    bad: list[int] = []
    for first in range(0, len(idx), 32):  # bounded: an encoding costs ~300 bytes a token
        bad += verify_prompts(ctx.tokenizer, prompts, indices=idx[first : first + 32])
    ctx.check.checked += len(idx)
    return bad
