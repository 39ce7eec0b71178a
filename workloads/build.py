"""Materialise a spec plus overrides into a `Workload` (table + manifest): the spec's source
(`workloads.sources`, by kind) decides the requests, this module gives them prompts where the
source did not, and writes the table and its manifest, in memory or straight to a file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from workloads.assemble import plain_prompts, prefixed_prompts
from workloads.classes import ClassColumns, classes_rng
from workloads.manifest import build_manifest
from workloads.options import WorkloadOptions
from workloads.prompts import Prompt, PromptSynthesizer
from workloads.schedule import Schedule, plan_schedule
from workloads.schema import (
    REQUEST_SCHEMA,
    SHA256_BATCHED,
    SHA256_ONE_BATCH,
    Workload,
    WorkloadError,
    table_sha256,
)
from workloads.sources import BuildContext, Rows
from workloads.spec import PrefixSpec, WorkloadSpec
from workloads.store import WorkloadWriter
from workloads.table import record_batches


def _plan(
    spec: WorkloadSpec,
    options: WorkloadOptions,
    tokenizer: Any,
    synthesizer: PromptSynthesizer | None,
) -> tuple[BuildContext, Schedule, Rows]:
    """The build's context, schedule and rows, every request with its prompt (the prompts of
    a streamed build are made as its chunks are read)."""
    if options.dataset_path is not None and not spec.source.reads_dataset:
        raise WorkloadError(f"Workload {spec.name!r} reads no dataset; drop dataset_path.")
    schedule = plan_schedule(spec, options)
    seed = options.seed if options.seed is not None else spec.seed
    ctx = BuildContext.start(spec.name, spec.base_dir, options, tokenizer, seed, synthesizer)
    rows = spec.source.rows(ctx, schedule)
    ctx.info["arrivals"] = rows.arrivals
    if rows.prompts is None:
        prompts, groups, ins = _prompts(ctx, spec.prefix, rows.ins)
        rows = replace(rows, ins=ins, prompts=iter([(prompts, groups)]))
    return ctx, schedule, rows


def _prompts(
    ctx: BuildContext, prefix: PrefixSpec | None, ins: np.ndarray
) -> tuple[list[Prompt], list[str | None] | None, np.ndarray]:
    """Synthesised prompts of `ins` tokens, after a shared prefix when the spec has one:
    the prompts, their prefix groups and their lengths (the prefix included)."""
    if prefix is None:
        return plain_prompts(ctx.synth, ins, ctx.rng_prompts, ctx.check), None, ins
    n, g, plen = len(ins), prefix.groups, prefix.prefix_len
    if prefix.assign == "random":
        groups = ctx.rng_mix.integers(0, g, size=n)
    else:
        groups = np.arange(n) % g
    prompts = prefixed_prompts(ctx.synth, ins, groups, plen, ctx.rng_prompts, ctx.check)
    ctx.info["prefix"] = {
        "groups": g,
        "prefix_len": plen,
        "assign": prefix.assign,
        "note": "input length = prefix_len + sampled suffix length",
    }
    return prompts, [f"group-{k}" for k in groups.tolist()], ins + plen


def _batches(spec: WorkloadSpec, ctx: BuildContext, rows: Rows):
    opts = ctx.options
    ignore_eos = opts.ignore_eos if opts.ignore_eos is not None else bool(spec.ignore_eos)
    return record_batches(
        rows,
        ignore_eos=ignore_eos,
        temperature=spec.temperature,
        top_p=spec.top_p,
        classes=_classes(spec, ctx, rows),
    )


def _classes(spec: WorkloadSpec, ctx: BuildContext, rows: Rows) -> ClassColumns | None:
    """Each request's tenant, priority and deadline (`workloads.classes`), from the build's
    fifth seeded stream; None when the spec sets none."""
    if spec.classes.empty:
        return None
    session_of_row = None
    if rows.sessions is not None:
        ids = rows.sessions.session_id
        number = {ids[row]: k for k, row in enumerate(rows.sessions.first_row.tolist())}
        session_of_row = np.asarray([number[sid] for sid in ids], dtype=np.int64)
    ctx.info["classes"] = spec.classes.describe()
    return spec.classes.sample(len(rows.ins), classes_rng(ctx.seed), session_of_row)


def build_workload(
    spec: WorkloadSpec,
    options: WorkloadOptions,
    tokenizer: Any,
    *,
    synthesizer: PromptSynthesizer | None = None,
) -> Workload:
    """Materialise `spec` with `options` for `tokenizer` in memory (see `resolve_workload` for
    caching, `build_workload_file` for bounded memory)."""
    ctx, schedule, rows = _plan(spec, options, tokenizer, synthesizer)
    table = pa.Table.from_batches(list(_batches(spec, ctx, rows)), schema=REQUEST_SCHEMA)
    of = SHA256_BATCHED if rows.streamed else SHA256_ONE_BATCH
    manifest = build_manifest(
        spec, ctx, schedule, rows, num_requests=table.num_rows, sha256=table_sha256(table, of=of)
    )
    return Workload(
        table=table, manifest=manifest, closed_loop_concurrency=schedule.closed_loop_concurrency
    )


def build_workload_file(
    spec: WorkloadSpec,
    options: WorkloadOptions,
    tokenizer: Any,
    path: Path,
    *,
    synthesizer: PromptSynthesizer | None = None,
) -> dict[str, Any]:
    """Materialise `spec` straight into the parquet file `path`, one chunk of rows at a time
    (bounded memory for trace-scale Mooncake builds); returns the manifest."""
    ctx, schedule, rows = _plan(spec, options, tokenizer, synthesizer)
    writer = WorkloadWriter(path, hash_rows=rows.streamed)
    try:
        if rows.streamed:
            for batch in _batches(spec, ctx, rows):
                writer.write(batch)
            num_requests, sha256 = writer.num_rows, writer.sha256()
        else:
            table = pa.Table.from_batches(list(_batches(spec, ctx, rows)), schema=REQUEST_SCHEMA)
            writer.write(table)
            num_requests, sha256 = table.num_rows, table_sha256(table)
        manifest = build_manifest(
            spec, ctx, schedule, rows, num_requests=num_requests, sha256=sha256
        )
    except BaseException:
        writer.abort()
        raise
    writer.close(manifest)
    return manifest
