"""Plan a run: the workload materialised, the target's answers to the preflight, the client
options, the load plan with its warm-up and sessions, the manifest, and the `RunContext` that
holds them, built in one go before anything is sent."""

from __future__ import annotations

import itertools
import sys
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

import harness
from harness.errors import HarnessError
from harness.http import sse_native
from harness.http.client import ClientOptions, RequestPayload, build_body, request_headers
from harness.http.events import (
    CHAT_TEMPLATED,
    TYPED_ENDPOINTS,
    typed_sessions_refusal,
)
from harness.load.loadgen import LoadPlan
from harness.load.prompt_watch import PromptTokenWatch
from harness.load.sessions import SessionPlan, sessions_from_rows
from harness.run.checks import iter_request_rows, output_checks, request_rows
from harness.run.config import RunConfig
from harness.run.context import ErrorLimits, RunContext, warn
from harness.run.dense_plan import batch_sizes, dense_rows, sent_batch_sizes
from harness.run.environment import (
    git_sha,
    hardware_info,
    recorded_command_line,
    software_versions,
)
from harness.targets.probe import preflight, target_info
from harness.targets.scraper import MetricsScraper
from harness.targets.target import Target
from harness.targets.tokenizer_choice import TokenizerChoice, chat_overhead_tokens
from slo.runrecord import Endpoint, RunManifest, release_free_memory
from workloads import WorkloadError, WorkloadOptions, resolve_workload

CHUNK_USAGE_ENGINES = ("engine_ref", "vllm")  # servers known to honour continuous_usage_stats


@dataclass(frozen=True)
class RunInputs:
    """What a run is made of, resolved before any target is contacted."""

    config: RunConfig
    workload: object  # workloads.Workload
    tokenizer: object
    slo_spec: dict | None
    run_dir: Path
    console: Console | None = None
    quiet: bool = True
    tokenizer_choice: TokenizerChoice | None = None

    def warn(self, sentence: str) -> None:
        """One warning sentence on the console (nothing for library callers without one)."""
        warn(self.console, sentence)


def materialise_workload(config: RunConfig, tokenizer):
    """Resolve `config.load.workload` into a `workloads.Workload` with the CLI's overrides."""
    load = config.load
    try:
        options = WorkloadOptions(
            num_requests=load.num_requests,
            input_len=load.input_len,
            output_len=load.output_len,
            range_ratio=load.range_ratio,
            request_rate=load.request_rate,
            burstiness=load.burstiness,
            seed=load.seed,
            ignore_eos=load.ignore_eos,
            dataset_path=load.dataset_path,
            endpoint=config.server.endpoint,
            duration_s=load.duration_s,
            concurrency=load.concurrency if load.is_closed_loop else None,
        )
        return resolve_workload(load.workload, options=options, tokenizer=tokenizer)
    except WorkloadError as exc:
        raise HarnessError(str(exc)) from exc


def chunk_usage_for(config: RunConfig, engine: str | None) -> bool:
    """Whether to ask for the usage so far in every chunk: `--chunk-usage`, else on for the
    engines known to honour it (others may reject an unknown stream option)."""
    if config.server.chunk_usage is not None:
        return config.server.chunk_usage
    return engine in CHUNK_USAGE_ENGINES


def plan_run(inputs: RunInputs, started: Target) -> RunContext:
    """Ask the started target what it serves, build the client options and the load plan,
    and return the run's `RunContext` (its manifest not yet written)."""
    config, workload, server = inputs.config, inputs.workload, inputs.config.server
    base_url, target = started.base_url, started.entry
    models = preflight(base_url, api_key=server.api_key, headers=server.headers)
    served = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
    model = server.model or (served[0] if served else None)
    if model is None:
        raise HarnessError(f"the target at {base_url} lists no model; name one with --model.")
    endpoint = Endpoint(
        server.endpoint or workload.manifest.get("endpoint") or Endpoint.COMPLETIONS
    )
    info = target_info(base_url, server.api_key, server.headers)
    overhead = chat_overhead_tokens(inputs.tokenizer) if endpoint in CHAT_TEMPLATED else 0
    target.update(
        model=model,
        endpoint=endpoint.value,
        engine=info.get("engine") or target.get("engine"),
        engine_version=info.get("version") or target.get("engine_version"),
        dtype=info.get("dtype"),
        quantization=info.get("quantization"),
        kernels=info.get("kernels"),
        dtype_choice=info.get("dtype_choice"),
        engine_config=info.get("engine_config"),
        kv_geometry=info.get("kv_geometry"),
        tokenizer=inputs.tokenizer_choice.to_dict() if inputs.tokenizer_choice else None,
        prompt_overhead_tokens=overhead,
    )
    options = ClientOptions(
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        stream=server.stream,
        timeout_s=server.timeout_s,
        api_key=server.api_key,
        headers=server.headers,
        extra_body=server.extra_body,
        chunk_usage=chunk_usage_for(config, target.get("engine")),
    )
    plan, input_tokens = load_plan(config, workload, options, inputs.tokenizer)
    sse_native.available()  # build the stream scanner now (about a second), not in the load
    release_free_memory()
    manifest = RunManifest(
        harness_version=harness.__version__,
        git_sha=git_sha(),
        command_line=recorded_command_line(sys.argv),
        target=target,
        hardware=hardware_info(),
        versions=software_versions(),
        workload=workload.manifest,
        slo=inputs.slo_spec,
        fault_plan=None,
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        config=config.to_dict(),
    )
    sessions = {}
    if plan.sessions is not None:
        sessions = {
            turn.request_id: (session.session_id, k)
            for session in plan.sessions.sessions
            for k, turn in enumerate(session.turns)
        }
    return RunContext(
        config=config,
        options=options,
        plan=plan,
        run_dir=inputs.run_dir,
        manifest=manifest,
        input_tokens=input_tokens,
        tokenizer=inputs.tokenizer,
        scraper=MetricsScraper(metrics_url(base_url), config.recording.scrape_interval_s),
        errors=ErrorLimits(config.stop.max_error_rate, config.stop.max_consecutive_errors),
        checks=output_checks(config, workload, inputs.tokenizer, endpoint),
        watch=PromptTokenWatch(overhead, inputs.warn),
        sessions=sessions,
        classes=request_classes(workload.table),
        batch_sizes=None if endpoint.generates else sent_batch_sizes(plan, endpoint),
        server=started.server,
        console=inputs.console,
        quiet=inputs.quiet,
    )


def request_classes(table) -> dict[str, tuple[int | None, int | None, str | None]]:
    """request id -> (priority, deadline_ms, tenant) of the workload's rows that have any,
    for the run records (`workloads.classes`)."""
    columns = [table.column(name).to_pylist() for name in ("priority", "deadline_ms", "tenant")]
    if not any(any(v is not None for v in column) for column in columns):
        return {}
    ids = table.column("request_id").to_pylist()
    return {
        rid: values
        for rid, *values in zip(ids, *columns, strict=True)
        if any(v is not None for v in values)
    }


def metrics_url(base_url: str) -> str:
    """The target's Prometheus `/metrics` beside its OpenAI base URL."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


def payload_of(options: ClientOptions, row: dict) -> RequestPayload:
    """One workload row as the client sends it: its body and its own headers."""
    return RequestPayload(row["request_id"], build_body(options, row), headers=request_headers(row))


class StreamedPayloads(Sequence[RequestPayload]):
    """The plan's requests, each body built from its workload row when the load reaches it:
    a plan holds the workload's Arrow table (columns) and the ids, not a body per request
    (about 1 KB each, issue "Runs that last"). Iterating builds the bodies in order again;
    an index or a slice walks to it (the split reads the first thousand, nothing else does)."""

    def __init__(self, rows: Callable[[], Iterator[dict]], ids: list[str], options) -> None:
        self._rows, self.ids, self._options = rows, ids, options

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[RequestPayload]:
        options = self._options
        for r in self._rows():
            yield payload_of(options, r)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return list(itertools.islice(self, start, max(start, stop), step))
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"request {index} of a plan of {len(self)}")
        return next(itertools.islice(self, position, None))


def _has_sessions(table) -> bool:
    return "session_id" in table.column_names and table.column("session_id").null_count < len(table)


def load_plan(
    config: RunConfig, workload, options: ClientOptions, tokenizer=None
) -> tuple[LoadPlan, dict[str, int]]:
    """The `LoadPlan` of the workload's rows as sent (with `config.load.warmup` warm-up
    requests repeating the first rows), and each request's input tokens. A generating
    endpoint's plan streams its bodies from the workload table (`StreamedPayloads`); a
    multi-turn plan and a batched (embeddings, rerank) one hold their rows."""
    load, table = config.load, workload.table
    if options.endpoint.generates and _has_sessions(table):  # the sessions need every row
        rows = request_rows(config, workload)
        warmup = warmup_payloads(load.warmup, options, rows)
        input_tokens = {r["request_id"]: r["input_tokens"] for r in rows}
        return session_plan(config, workload, options, rows, warmup, tokenizer), input_tokens
    if options.endpoint.generates:
        ids = table.column("request_id").to_pylist()
        input_tokens = dict(zip(ids, table.column("input_tokens").to_pylist(), strict=True))
        arrival = table.column("arrival_s")
        head = list(itertools.islice(iter_request_rows(config, workload), load.warmup))
        payloads = StreamedPayloads(lambda: iter_request_rows(config, workload), ids, options)
        closed = arrival.null_count > 0
        # 8 bytes a request (a list of floats: 32)
        arrivals = None if closed else array("d", arrival.to_numpy(zero_copy_only=False))
    else:  # embeddings, rerank: a batch of texts a request
        rows = list(iter_request_rows(config, workload))
        seed = load.seed if load.seed is not None else workload.manifest.get("seed") or 0
        rows = dense_rows(rows, options.endpoint, batch_sizes(load.batch_size, len(rows), seed))
        payloads = [payload_of(options, r) for r in rows]
        input_tokens = {r["request_id"]: r["input_tokens"] for r in rows}
        closed = any(r["arrival_s"] is None for r in rows)
        arrivals = None if closed else [float(r["arrival_s"]) for r in rows]
        head = rows[: load.warmup]
    if not payloads:
        raise HarnessError("the workload has no requests; raise --num-requests or --duration.")
    warmup = warmup_payloads(load.warmup, options, head)
    if closed or workload.closed_loop_concurrency is not None:
        users = workload.closed_loop_concurrency or load.concurrency
        if not users:
            raise HarnessError("a closed-loop workload needs --concurrency (the number of users).")
        plan = LoadPlan(payloads, None, users, load.duration_s, warmup)
    else:
        plan = LoadPlan(payloads, arrivals, load.concurrency, load.duration_s, warmup)
    return plan, input_tokens


def session_plan(config, workload, options: ClientOptions, rows, warmup, tokenizer) -> LoadPlan:
    """A multi-turn plan: the sessions, and every turn listed for the schedule (a later turn's
    arrival is null: it waits for the turn before it)."""
    if options.endpoint in TYPED_ENDPOINTS:
        raise HarnessError(typed_sessions_refusal(options.endpoint))
    if config.recording.check_outputs:
        raise HarnessError(
            "--check-outputs compares single prompts with the reference engine; it does not "
            "apply to multi-turn sessions, whose prompts depend on the answers."
        )
    sessions = SessionPlan(
        sessions_from_rows(rows, options),
        chat=options.is_chat,
        session_header=config.load.session_header,
        encode=getattr(tokenizer, "encode", None),
    )
    turns = [RequestPayload(r["request_id"], b"") for r in rows]
    users = workload.closed_loop_concurrency
    arrivals = None if users else [r["arrival_s"] for r in rows]
    return LoadPlan(
        turns, arrivals, users or config.load.concurrency, config.load.duration_s, warmup, sessions
    )


def warmup_payloads(count: int, options: ClientOptions, rows: list[dict]) -> list[RequestPayload]:
    """`count` warm-up requests repeating `rows` in turn."""
    return [
        RequestPayload(f"warmup-{i}", build_body(options, rows[i % len(rows)]), is_warmup=True)
        for i in range(count)
    ]
