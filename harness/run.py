"""Run orchestration: workload -> (managed) target -> load loop -> run directory -> summary."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console

import harness
from harness.config import RunConfig
from harness.environment import git_sha, hardware_info, software_versions
from harness.errors import HarnessError
from harness.fault_session import FaultSession
from harness.http import sse_native
from harness.http.client import AiohttpTransport, ClientOptions, RequestPayload, build_body
from harness.http.transport import Transport
from harness.loadgen import LoadPlan, run_load
from harness.outcome import EXIT_OK, Verdict, judge, not_found_sentence
from harness.progress import ProgressDisplay
from harness.prompt_watch import PromptTokenWatch
from harness.recorder import prepare_run_dir
from harness.run_checks import iter_request_rows, output_checks, request_rows, tally_outputs
from harness.run_context import ErrorLimits, RunContext
from harness.saturation_watch import Observers, SaturationWatch
from harness.sessions import SessionPlan, sessions_from_rows
from harness.targets.probe import preflight, target_info
from harness.targets.process import ServerProcess
from harness.targets.scraper import MetricsScraper
from harness.targets.server_state import read_gauges, settle
from harness.targets.target import Target, launch_plan_for, target_for
from harness.targets.tokenizer_choice import (
    TokenizerChoice,
    chat_overhead_tokens,
    choose_for_run,
    load_chosen,
)
from slo.runrecord import (
    Endpoint,
    RunManifest,
    RunSummary,
    open_run,
    read_manifest,
    write_json_atomic,
    write_summary,
)


@dataclass(frozen=True)
class RunOutcome:
    """Where the run went and what it found; `summary` is `slo.summarize`'s dict."""

    run_dir: Path
    summary: dict
    complete: bool
    interrupted_reason: str | None
    verdict: Verdict = Verdict(EXIT_OK, None)
    stopped_by_errors: bool = False


def run_event_loop(coro):
    """Run `coro` on uvloop when it is installed (lower per-event overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def default_run_dir(config: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = (
        Path(config.load.workload).stem
        if Path(config.load.workload).suffix
        else config.load.workload
    )
    return Path("runs") / f"{stamp}-{name}"


def load_tokenizer_for(config: RunConfig, plan=None):
    """The tokenizer that counts prompt tokens (and output tokens where usage is missing): the
    model under test's (see `harness.targets.tokenizer_choice`)."""
    return load_chosen(choose_for_run(config.server, plan))


def warn(console: Console | None, sentence: str) -> None:
    """One warning sentence on the console (nothing for library callers without one)."""
    if console is not None:
        console.print(
            f"warning: {sentence}", style="yellow", markup=False, highlight=False, soft_wrap=True
        )


def materialise_workload(config: RunConfig, tokenizer):
    """Resolve `config.load.workload` into a `workloads.Workload` with the CLI's overrides."""
    from workloads import WorkloadError, WorkloadOptions, resolve_workload

    try:
        options = WorkloadOptions(
            num_requests=config.load.num_requests,
            input_len=config.load.input_len,
            output_len=config.load.output_len,
            range_ratio=config.load.range_ratio,
            request_rate=config.load.request_rate,
            burstiness=config.load.burstiness,
            seed=config.load.seed,
            ignore_eos=config.load.ignore_eos,
            dataset_path=config.load.dataset_path,
            endpoint=config.server.endpoint,
            duration_s=config.load.duration_s,
            concurrency=config.load.concurrency if config.load.is_closed_loop else None,
        )
        return resolve_workload(config.load.workload, options=options, tokenizer=tokenizer)
    except WorkloadError as exc:
        raise HarnessError(str(exc)) from exc


def load_fault_plan(name: str | None):
    """The `faults.plan.FaultPlan` named by `--faults` (a file or a built-in), or None."""
    if name is None:
        return None
    from faults.plan import FaultPlanError, load_plan

    try:
        return load_plan(name)
    except FaultPlanError as exc:
        raise HarnessError(str(exc)) from exc


def load_slo_spec(name: str | dict | None) -> dict | None:
    """The SLO spec dict for `--slo` (a name or file) or for one already built (`--goodput`)."""
    if name is None:
        return None
    from slo import SLOError
    from slo.spec import as_spec

    try:
        return as_spec(name).to_dict()
    except SLOError as exc:
        raise HarnessError(str(exc)) from exc


def run_benchmark(
    config: RunConfig,
    *,
    console: Console | None = None,
    quiet: bool = True,
    target: Target | None = None,
    tokenizer=None,
    transport: Transport | None = None,
) -> RunOutcome:
    """Run one benchmark end to end and return where its run directory is.

    Bad input raises `HarnessError` before anything is written. Ctrl-C (SIGINT) or SIGTERM
    stops the run: in-flight requests are recorded as `cancelled` and the run directory is
    closed and marked incomplete; the outcome says so. `target` reuses a target the caller
    already started, as a capacity search does for its probes.
    `transport` replaces the aiohttp client for every request (a test double); `--faults`
    (`config.faults`) puts a fault plan's proxy and client wrappers in front of it.
    """
    fault_plan = load_fault_plan(config.faults)
    slo_spec = load_slo_spec(config.recording.slo)
    if config.load.ray_address is not None:
        from harness.ray_workers import require_ray

        require_ray()  # before anything is contacted: a missing extra is one sentence
    run_dir = Path(config.recording.out or default_run_dir(config))
    with removed_if_left_empty(run_dir):
        prepare_run_dir(run_dir)
        plan = launch_plan_for(config.server) if target is None else target.plan
        choice = choose_for_run(config.server, plan)
        if choice.warning and tokenizer is None:
            warn(console, choice.warning)
        tokenizer = tokenizer or load_chosen(choice)
        inputs = RunInputs(
            config=config,
            workload=materialise_workload(config, tokenizer),
            tokenizer=tokenizer,
            slo_spec=slo_spec,
            run_dir=run_dir,
            console=console,
            quiet=quiet,
            transport=transport,
            fault_plan=fault_plan,
            tokenizer_choice=choice,
        )
        if target is not None:
            started = Target(target.base_url, dict(target.entry), target.server, target.plan)
            return _run_against(inputs, started)
        engine_args = fault_plan.managed_engine_args if fault_plan is not None else ()
        with target_for(
            config.server, log_dir=run_dir, plan=plan, extra_args=engine_args
        ) as started:
            return _run_against(inputs, started)


@contextlib.contextmanager
def removed_if_left_empty(run_dir: Path):
    """Remove `run_dir` again when the run fails before writing anything into it (a bad
    workload, an unreachable target), so a refused run leaves nothing on disk."""
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first
    try:
        yield
    except BaseException:
        for path in created:  # the run directory, then parents made for it (e.g. runs/)
            if not path.is_dir() or any(path.iterdir()):
                break
            path.rmdir()
        raise


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
    transport: Transport | None = None
    fault_plan: object | None = None  # faults.plan.FaultPlan
    tokenizer_choice: TokenizerChoice | None = None


def _run_against(inputs: RunInputs, started: Target) -> RunOutcome:
    config, workload, run_dir = inputs.config, inputs.workload, inputs.run_dir
    base_url, target = started.base_url, started.entry
    models = preflight(base_url, api_key=config.server.api_key, headers=config.server.headers)
    served = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
    model = config.server.model or (served[0] if served else None)
    if model is None:
        raise HarnessError(f"the target at {base_url} lists no model; name one with --model.")
    endpoint = Endpoint(
        config.server.endpoint or workload.manifest.get("endpoint") or Endpoint.COMPLETIONS
    )
    info = target_info(base_url, config.server.api_key, config.server.headers)
    overhead = chat_overhead_tokens(inputs.tokenizer) if endpoint is Endpoint.CHAT else 0
    target.update(
        model=model,
        endpoint=endpoint.value,
        engine=info.get("engine") or target.get("engine"),
        engine_version=info.get("version") or target.get("engine_version"),
        dtype=info.get("dtype"),
        engine_config=info.get("engine_config"),
        tokenizer=inputs.tokenizer_choice.to_dict() if inputs.tokenizer_choice else None,
        prompt_overhead_tokens=overhead,
    )
    options = ClientOptions(
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        stream=config.server.stream,
        timeout_s=config.server.timeout_s,
        api_key=config.server.api_key,
        headers=config.server.headers,
        extra_body=config.server.extra_body,
        chunk_usage=_chunk_usage(config, target.get("engine")),
    )
    plan, input_tokens = _plan(config, workload, options, inputs.tokenizer)
    sse_native.available()  # build the stream scanner now (about a second), not in the load
    release_free_memory()
    manifest = RunManifest(
        harness_version=harness.__version__,
        git_sha=git_sha(),
        command_line=sys.argv,
        target=target,
        hardware=hardware_info(),
        versions=software_versions(),
        workload=workload.manifest,
        slo=inputs.slo_spec,
        fault_plan=None,
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        config=config.to_dict(),
    )
    run = RunContext(
        config=config,
        options=options,
        plan=plan,
        run_dir=run_dir,
        manifest=manifest,
        input_tokens=input_tokens,
        tokenizer=inputs.tokenizer,
        scraper=MetricsScraper(
            base_url.rstrip("/").removesuffix("/v1") + "/metrics",
            config.recording.scrape_interval_s,
        ),
        console=inputs.console,
        quiet=inputs.quiet,
        server=started.server,
    )
    run.errors = ErrorLimits(config.stop.max_error_rate, config.stop.max_consecutive_errors)
    if plan.sessions is not None:
        run.sessions = {
            turn.request_id: (session.session_id, k)
            for session in plan.sessions.sessions
            for k, turn in enumerate(session.turns)
        }
    run.checks = output_checks(config, workload, inputs.tokenizer, endpoint)
    run.watch = PromptTokenWatch(overhead, lambda sentence: warn(inputs.console, sentence))
    metrics_url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    idle_before = read_gauges(metrics_url, api_key=config.server.api_key)
    reason: str | None = "the harness stopped unexpectedly"
    server_state = None
    split = _worker_split(config, plan, options, inputs)
    try:
        if split is None:
            reason = asyncio.run(_drive(run, inputs.transport, inputs.fault_plan, started.server))
        elif config.load.ray_address is not None:
            from harness.ray_workers import drive_ray

            reason = asyncio.run(drive_ray(run, split, lambda i, s: warn(inputs.console, s)))
        else:
            reason = asyncio.run(
                _drive_workers(run, split.shares, lambda i, s: warn(inputs.console, s))
            )
        death = run.server_death() if reason is None else None
        if death is not None:  # it died after the watch's last look, before the load ended
            run.request_stop(death)
            reason = death
        server_state = settle(
            metrics_url,
            idle_before,
            api_key=config.server.api_key,
            settle_s=config.recording.settle_s,
        )
    except BaseException as exc:
        reason = f"the harness crashed: {type(exc).__name__}: {exc}"
        raise
    finally:
        run.close(reason, server_state)
    if split is not None:
        _record_workers(run_dir, split, run.workers or [])
    stopped_by_errors = run.stop_reason is not None and reason == run.stop_reason
    outcome = _summarise(run_dir, inputs.slo_spec, config, reason)
    requests = open_run(run_dir, chunks=False).requests
    verdict = judge(
        outcome.summary,
        stopped_reason=reason,
        stopped_by_errors=stopped_by_errors,
        slo_given=inputs.slo_spec is not None,
        outputs=tally_outputs(requests) if config.recording.check_outputs else None,
        not_found=_not_found_hint(requests, options),
    )
    _record_outcome(run_dir, verdict)
    return RunOutcome(
        run_dir=run_dir,
        summary=outcome.summary,
        complete=outcome.complete,
        interrupted_reason=reason,
        verdict=verdict,
        stopped_by_errors=stopped_by_errors,
    )


def _worker_split(config: RunConfig, plan: LoadPlan, options: ClientOptions, inputs):
    """The `harness.workers.WorkerSplit` for `--workers`/`--ray`, or None for one process."""
    if config.load.ray_address is None and config.load.workers in (None, 1):
        return None
    from harness.workers import check_workers_supported, split_for

    check_workers_supported(inputs.transport)
    return split_for(config, plan, options)


def _record_workers(run_dir: Path, split, entries: list[dict]) -> None:
    """The manifest's `workers` section: the split, the clocks, and per worker its requests,
    fate and dispatch lag (ms, over the requests it sent)."""
    import numpy as np

    from slo import metrics
    from slo.runrecord import RequestColumn, float_column, open_run

    requests = open_run(run_dir, chunks=False).requests
    owner = split.worker_of()
    ids = requests[RequestColumn.REQUEST_ID].to_pylist()
    lag = metrics.dispatch_lag_ms(  # the summary's definition: a cap's queueing is not lag
        float_column(requests, RequestColumn.T_SCHEDULED_NS),
        float_column(requests, RequestColumn.T_SENT_NS),
        float_column(requests, RequestColumn.T_SLOT_FREED_NS),
    )
    of = np.array([owner.get(rid, -1) for rid in ids])
    per_worker = []
    for entry in entries:
        dist = metrics.distribution(lag[of == entry["worker"]])
        per_worker.append(
            {**entry, "dispatch_lag_ms": {k: dist[k] for k in ("p50", "p99", "max", "n")}}
        )
    section = {**split.manifest_entry(), "per_worker": per_worker}
    manifest = read_manifest(run_dir).evolve(workers=section)
    write_json_atomic(run_dir / "manifest.json", manifest.to_json())


def _not_found_hint(requests, options: ClientOptions) -> str | None:
    """`not_found_sentence` for the run's requests table (the first by send time decides)."""
    import numpy as np

    from slo.runrecord import RequestColumn, float_column

    sent = float_column(requests, RequestColumn.T_SENT_NS)
    status = float_column(requests, RequestColumn.HTTP_STATUS)
    n_sent = int((~np.isnan(sent)).sum())
    if not n_sent:
        return None
    first = status[int(np.nanargmin(sent))]
    first_status = None if np.isnan(first) else int(first)
    n_not_found = int((status == 404).sum())
    return not_found_sentence(
        options.base_url,
        options.url,
        first_status,
        n_not_found,
        n_sent,
        not_sent=len(status) - n_sent,
    )


def _record_outcome(run_dir: Path, verdict: Verdict) -> None:
    manifest = read_manifest(run_dir).evolve(outcome=verdict.to_dict())
    write_json_atomic(run_dir / "manifest.json", manifest.to_json())


CHUNK_USAGE_ENGINES = ("engine_ref", "vllm")  # servers known to honour continuous_usage_stats


def _chunk_usage(config: RunConfig, engine: str | None) -> bool:
    """Whether to ask for the usage so far in every chunk: `--chunk-usage`, else on for the
    engines known to honour it (others may reject an unknown stream option)."""
    if config.server.chunk_usage is not None:
        return config.server.chunk_usage
    return engine in CHUNK_USAGE_ENGINES


def _session_plan(config, workload, options: ClientOptions, rows, warmup, tokenizer) -> LoadPlan:
    """A multi-turn plan: the sessions, and every turn listed for the schedule (a later turn's
    arrival is null: it waits for the turn before it)."""
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


def release_free_memory() -> None:
    """Hand back to the system what building the workload and the plan freed, before the load:
    glibc's malloc and Arrow's pool otherwise keep it, and the run's memory then grows with
    the workload's size (30,000 generated requests kept about 90 MB this way). No-op where
    glibc is not the allocator."""
    import ctypes
    import gc

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _plan(
    config: RunConfig, workload, options: ClientOptions, tokenizer=None
) -> tuple[LoadPlan, dict[str, int]]:
    payloads: list[RequestPayload] = []
    input_tokens: dict[str, int] = {}
    arrivals: list[float | None] = []
    head: list[dict] = []  # the rows the warm-up requests repeat
    for r in iter_request_rows(config, workload):
        if r.get("session_id") is not None:  # multi-turn: the sessions need every row
            rows = request_rows(config, workload)
            warmup = _warmup(config, options, rows)
            input_tokens = {r["request_id"]: r["input_tokens"] for r in rows}
            return _session_plan(config, workload, options, rows, warmup, tokenizer), input_tokens
        payloads.append(RequestPayload(r["request_id"], build_body(options, r)))
        input_tokens[r["request_id"]] = r["input_tokens"]
        arrivals.append(None if r["arrival_s"] is None else float(r["arrival_s"]))
        if len(head) < config.load.warmup:
            head.append(r)
    if not payloads:
        raise HarnessError("the workload has no requests; raise --num-requests or --duration.")
    warmup = _warmup(config, options, head)
    closed = workload.closed_loop_concurrency is not None or any(a is None for a in arrivals)
    if closed:
        users = workload.closed_loop_concurrency or config.load.concurrency
        if not users:
            raise HarnessError("a closed-loop workload needs --concurrency (the number of users).")
        plan = LoadPlan(payloads, None, users, config.load.duration_s, warmup)
    else:
        plan = LoadPlan(payloads, arrivals, config.load.concurrency, config.load.duration_s, warmup)
    return plan, input_tokens


def _warmup(config: RunConfig, options: ClientOptions, rows: list[dict]) -> list[RequestPayload]:
    """`config.load.warmup` requests repeating the first rows in turn."""
    return [
        RequestPayload(f"warmup-{i}", build_body(options, rows[i % len(rows)]), is_warmup=True)
        for i in range(config.load.warmup)
    ]


SERVER_POLL_S = 0.05  # how often the managed server's process is checked during the load


async def _watch_server(run: RunContext) -> None:
    """Stop the run (exit 3) once the managed server died: the rest would meet a closed port."""
    while True:
        await asyncio.sleep(SERVER_POLL_S)
        death = run.server_death()
        if death is not None:
            run.request_stop(death)
            return


@contextlib.asynccontextmanager
async def _run_services(run: RunContext):
    """Signal handling (SIGINT/SIGTERM cancel the driving task), periodic flushes, the
    `/metrics` scraper and the watch on a managed server's process around one run's load
    phase; yields `{reason}` set by a signal."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    run.stop = main
    stop_reason: dict = {}

    def interrupt(signame: str) -> None:
        stop_reason.setdefault("reason", f"interrupted by {signame}")
        main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, interrupt, sig.name)

    async def flusher() -> None:
        while True:
            await asyncio.sleep(run.config.recording.flush_interval_s)
            run.flush()

    flush_task = asyncio.create_task(flusher())
    watch_task = asyncio.create_task(_watch_server(run)) if run.server is not None else None
    scrape_task = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            if run.config.recording.scrape_interval_s > 0:
                session = await stack.enter_async_context(aiohttp.ClientSession())
                scrape_task = asyncio.create_task(run.scraper.run(session, lambda: run.t0_ns))
            yield stop_reason
            if scrape_task is not None:
                scrape_task.cancel()
                await run.scraper.scrape_once(session, lambda: run.t0_ns)
    finally:
        flush_task.cancel()
        if watch_task is not None:
            watch_task.cancel()
        if scrape_task is not None:
            scrape_task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def _observer(run: RunContext, total: int):
    """The progress display (unless quiet), the saturation watch and the run's own count of
    requests in flight, as one observer."""
    display = (
        ProgressDisplay(total, run.console) if (not run.quiet and run.console is not None) else None
    )
    watch = SaturationWatch(run.request_stop) if run.config.stop.stop_on_saturation else None
    return display, Observers(display, watch, run)


async def _drive(
    run: RunContext,
    transport: Transport | None,
    fault_plan=None,
    server: ServerProcess | None = None,
) -> str | None:
    """Run the load loop with signal handling and periodic flushes; returns why it stopped early.

    `transport` replaces the aiohttp client (tests); None uses the default. `fault_plan` puts
    a `FaultSession` (proxy, client faults, engine faults) in front of the target.
    """
    plan = run.plan
    max_connections = plan.concurrency or max(len(plan.payloads), len(plan.warmup), 1)
    display, observer = _observer(run, len(plan.payloads))
    stop_reason: dict = {}
    try:
        async with _run_services(run) as stop_reason, contextlib.AsyncExitStack() as stack:
            start = run.start
            if fault_plan is not None:
                fault_session = FaultSession(
                    fault_plan,
                    run.options,
                    server=server,
                    max_connections=min(max_connections, 4096),
                )
                # Registered first, so it runs last: after the session closed its windows.
                stack.callback(lambda: run.set_fault_plan(fault_session.manifest_entry()))
                transport = await stack.enter_async_context(fault_session)

                def start(t0_ns: int) -> None:
                    run.start(t0_ns)
                    fault_session.start(t0_ns)

            elif transport is None:
                transport = await stack.enter_async_context(
                    AiohttpTransport(run.options, max_connections=min(max_connections, 4096))
                )
            with display or contextlib.nullcontext():
                await run_load(transport, plan, run.on_result, observer, start_callback=start)
    except asyncio.CancelledError:
        return stop_reason.get("reason") or run.stop_reason or "cancelled"
    return None


async def _drive_workers(run: RunContext, shares, on_lost) -> str | None:
    """`_drive` for `--workers`: the shares run in worker processes (`harness.workers`); this
    process records their results. Returns why the run stopped early, or None."""
    from harness.workers import STOP_GRACE_S, WorkerPool

    display, observer = _observer(run, len(run.plan.payloads))
    lost: list[str] = []

    def worker_lost(index: int, sentence: str) -> None:
        lost.append(sentence)
        on_lost(index, sentence)
        if run.config.stop.on_worker_failure == "stop":
            run.request_stop(
                f"{sentence} mid-run; the other workers were stopped (--on-worker-failure stop)"
            )

    pool = WorkerPool(shares, run.on_result, run.start, worker_lost, observer)
    stop_reason: dict = {}
    try:
        async with _run_services(run) as stop_reason:
            pool.start()
            with display or contextlib.nullcontext():
                try:
                    await pool.wait()
                except asyncio.CancelledError:
                    pool.stop()
                    try:
                        await asyncio.wait_for(pool.wait(), STOP_GRACE_S)
                    except TimeoutError:
                        pool.kill_stragglers()
                        await pool.wait()
                    raise
    except asyncio.CancelledError:
        return stop_reason.get("reason") or run.stop_reason or "cancelled"
    finally:
        pool.close()
        run.workers = pool.manifest_entries()
    if lost:
        return (
            f"{'; '.join(lost)} mid-run: its in-flight requests are unknown, its unsent ones "
            "not_sent; the other workers ran to the end (--on-worker-failure continue)"
        )
    return None


def _summarise(
    run_dir: Path, slo_spec: dict | None, config: RunConfig, reason: str | None
) -> RunOutcome:
    from slo import summarize

    summary = summarize(
        run_dir, slo_spec, client_bound_ms=config.recording.client_bound_ms, conventions="all"
    )
    write_summary(run_dir, RunSummary.from_dict(summary))
    return RunOutcome(
        run_dir=run_dir, summary=summary, complete=reason is None, interrupted_reason=reason
    )
