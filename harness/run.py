"""Run orchestration: workload -> (managed) target -> load loop -> run directory -> summary."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

import harness
from harness.client import ClientOptions, RawResult, RequestPayload, build_body, make_session
from harness.config import RunConfig
from harness.environment import git_sha, hardware_info, software_versions
from harness.errors import HarnessError
from harness.loadgen import LoadPlan, run_load
from harness.managed import ManagedServerConfig, managed_server
from harness.progress import ProgressDisplay
from harness.recorder import RunRecorder, prepare_run_dir, write_json_atomic
from harness.records import RecordContext
from harness.scraper import MetricsScraper

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class RunOutcome:
    """Where the run went and what it found; `summary` is `slo.summarize`'s dict."""

    run_dir: Path
    summary: dict
    complete: bool
    interrupted_reason: str | None


def run_event_loop(coro):
    """Run `coro` on uvloop when it is installed (lower per-event overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def default_run_dir(config: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = Path(config.workload).stem if Path(config.workload).suffix else config.workload
    return Path("runs") / f"{stamp}-{name}"


def load_tokenizer_for(config: RunConfig):
    """The tokenizer that counts prompt tokens (and output tokens where usage is missing)."""
    from engine_ref.loading.weights import load_tokenizer

    name = config.tokenizer or (
        config.model if config.url is None and config.model else DEFAULT_MODEL
    )
    try:
        return load_tokenizer(name)
    except Exception as exc:  # the loader's own errors are one sentence; keep them so
        raise HarnessError(f"cannot load the tokenizer {name!r}: {exc}") from exc


def materialise_workload(config: RunConfig, tokenizer):
    """Resolve `config.workload` into a `workloads.Workload` with the CLI's overrides."""
    from workloads import WorkloadError, WorkloadOptions, resolve_workload

    try:
        options = WorkloadOptions(
            num_requests=config.num_requests,
            input_len=config.input_len,
            output_len=config.output_len,
            range_ratio=config.range_ratio,
            request_rate=config.request_rate,
            burstiness=config.burstiness,
            seed=config.seed,
            ignore_eos=config.ignore_eos,
            dataset_path=config.dataset_path,
            endpoint=config.endpoint,
            duration_s=config.duration_s,
            concurrency=config.concurrency if config.is_closed_loop else None,
        )
        return resolve_workload(config.workload, options=options, tokenizer=tokenizer)
    except WorkloadError as exc:
        raise HarnessError(str(exc)) from exc


def load_slo_spec(name: str | None) -> dict | None:
    if name is None:
        return None
    from slo import SLOError, load_slo

    try:
        return load_slo(name).to_dict()
    except SLOError as exc:
        raise HarnessError(str(exc)) from exc


def preflight(base_url: str, timeout_s: float = 10.0) -> dict:
    """GET `<base_url>/models`: proves the target is reachable; returns its JSON (or {})."""
    url = base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError:
        return {}  # reachable; some servers have no /models
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise HarnessError(
            f"cannot reach the target at {base_url} ({reason}); check --url and that the server is running."
        ) from exc
    except json.JSONDecodeError:
        return {}


def target_info(base_url: str) -> dict:
    """The reference engine's `/info` (engine, version, model, dtype, config), when present."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(root + "/info", timeout=5) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return {}


@contextlib.contextmanager
def target_for(config: RunConfig):
    """Yield `(base_url, target manifest dict)`: `config.url`, or a managed reference server."""
    if config.url is not None:
        yield config.url, {"kind": "url", "url": config.url}
        return
    server_cfg = ManagedServerConfig(
        model=config.model or DEFAULT_MODEL,
        extra_args=config.server_args,
        startup_timeout_s=config.startup_timeout_s,
    )
    with managed_server(server_cfg) as server:
        yield (
            server.base_url,
            {"kind": "managed", "url": server.base_url, "server_log": str(server.log_path)},
        )


def run_benchmark(
    config: RunConfig,
    *,
    console: Console | None = None,
    quiet: bool = True,
    target: tuple[str, dict] | None = None,
    tokenizer=None,
) -> RunOutcome:
    """Run one benchmark end to end and return where its run directory is.

    Bad input raises `HarnessError` before anything is written. Ctrl-C (SIGINT) or SIGTERM
    stops the run: in-flight requests are recorded as `cancelled` and the run directory is
    closed and marked incomplete; the outcome says so. `target` (base URL, manifest entry)
    reuses a target the caller already started, as a capacity search does for its probes.
    """
    run_dir = prepare_run_dir(config.out or default_run_dir(config))
    slo_spec = load_slo_spec(config.slo)
    tokenizer = tokenizer or load_tokenizer_for(config)
    workload = materialise_workload(config, tokenizer)
    if target is not None:
        base_url, entry = target
        return _run_against(
            config, base_url, dict(entry), workload, tokenizer, slo_spec, run_dir, console, quiet
        )
    with target_for(config) as (base_url, entry):
        return _run_against(
            config, base_url, entry, workload, tokenizer, slo_spec, run_dir, console, quiet
        )


def _run_against(
    config, base_url, target, workload, tokenizer, slo_spec, run_dir, console, quiet
) -> RunOutcome:
    models = preflight(base_url)
    served = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
    model = config.model or (served[0] if served else None)
    if model is None:
        raise HarnessError(f"the target at {base_url} lists no model; name one with --model.")
    info = target_info(base_url)
    target.update(
        model=model,
        endpoint=config.endpoint,
        engine=info.get("engine"),
        engine_version=info.get("version"),
        dtype=info.get("dtype"),
        engine_config=info.get("engine_config"),
    )
    options = ClientOptions(
        base_url=base_url,
        model=model,
        endpoint=config.endpoint,
        stream=config.stream,
        timeout_s=config.timeout_s,
        api_key=config.api_key,
    )
    plan, input_tokens = _plan(config, workload, options)
    manifest = {
        "harness_version": harness.__version__,
        "git_sha": git_sha(),
        "command_line": sys.argv,
        "target": target,
        "hardware": hardware_info(),
        "versions": software_versions(),
        "workload": workload.manifest,
        "slo": slo_spec,
        "fault_plan": None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config.to_dict(),
    }
    recorder_holder: dict = {}
    scraper = MetricsScraper(
        base_url.rstrip("/").removesuffix("/v1") + "/metrics", config.scrape_interval_s
    )

    def start(t0_ns: int) -> None:
        manifest["t0_ns"] = t0_ns
        recorder_holder["t0"] = t0_ns
        context = RecordContext(
            t0_ns=t0_ns,
            is_chat=options.is_chat,
            count_tokens=lambda text: len(tokenizer.encode(text)),
        )
        recorder = RunRecorder(run_dir, context, input_tokens, manifest)
        for raw in recorder_holder.pop("early", []):
            recorder.add(raw)
        recorder_holder["rec"] = recorder

    def on_result(raw: RawResult) -> None:
        recorder = recorder_holder.get("rec")
        if recorder is None:
            recorder_holder.setdefault("early", []).append(raw)
        else:
            recorder.add(raw)

    reason: str | None = "the harness stopped unexpectedly"
    try:
        reason = asyncio.run(
            _drive(
                config, options, plan, start, on_result, recorder_holder, console, quiet, scraper
            )
        )
    except BaseException as exc:
        reason = f"the harness crashed: {type(exc).__name__}: {exc}"
        raise
    finally:
        if "rec" not in recorder_holder:  # stopped during warm-up: still leave a readable run
            start(time.perf_counter_ns())
        scraped = scraper.write(run_dir)
        recorder_holder["rec"].close(
            complete=reason is None, reason=reason, extra={"server_metrics_samples": scraped}
        )
    return _summarise(run_dir, slo_spec, config, reason)


def _plan(config: RunConfig, workload, options: ClientOptions) -> tuple[LoadPlan, dict[str, int]]:
    rows = workload.table.to_pylist()
    if not rows:
        raise HarnessError("the workload has no requests; raise --num-requests or --duration.")
    payloads = [RequestPayload(r["request_id"], build_body(options, r)) for r in rows]
    warmup = [
        RequestPayload(f"warmup-{i}", build_body(options, rows[i % len(rows)]), is_warmup=True)
        for i in range(config.warmup)
    ]
    input_tokens = {r["request_id"]: r["input_tokens"] for r in rows}
    closed = workload.closed_loop_concurrency is not None or any(
        r["arrival_s"] is None for r in rows
    )
    if closed:
        users = workload.closed_loop_concurrency or config.concurrency
        if not users:
            raise HarnessError("a closed-loop workload needs --concurrency (the number of users).")
        plan = LoadPlan(payloads, None, users, config.duration_s, warmup)
    else:
        arrivals = [float(r["arrival_s"]) for r in rows]
        plan = LoadPlan(payloads, arrivals, config.concurrency, config.duration_s, warmup)
    return plan, input_tokens


async def _drive(
    config, options, plan, start, on_result, recorder_holder, console, quiet, scraper
) -> str | None:
    """Run the load loop with signal handling and periodic flushes; returns why it stopped early."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stop_reason: dict = {}

    def interrupt(signame: str) -> None:
        stop_reason.setdefault("reason", f"interrupted by {signame}")
        main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, interrupt, sig.name)

    async def flusher() -> None:
        while True:
            await asyncio.sleep(config.flush_interval_s)
            recorder = recorder_holder.get("rec")
            if recorder is not None:
                recorder.flush()

    max_connections = plan.concurrency or max(len(plan.payloads), len(plan.warmup), 1)
    flush_task = asyncio.create_task(flusher())
    scrape_task = None
    display = (
        ProgressDisplay(len(plan.payloads), console)
        if (not quiet and console is not None)
        else None
    )
    try:
        async with make_session(options, max_connections=min(max_connections, 4096)) as session:
            if config.scrape_interval_s > 0:
                scrape_task = asyncio.create_task(
                    scraper.run(session, lambda: recorder_holder.get("t0"))
                )
            with display or contextlib.nullcontext():
                await run_load(session, options, plan, on_result, display, start_callback=start)
    except asyncio.CancelledError:
        return stop_reason.get("reason", "cancelled")
    finally:
        flush_task.cancel()
        if scrape_task is not None:
            scrape_task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    return None


def _summarise(
    run_dir: Path, slo_spec: dict | None, config: RunConfig, reason: str | None
) -> RunOutcome:
    from slo import summarize

    summary = summarize(run_dir, slo_spec, client_bound_ms=config.client_bound_ms)
    write_json_atomic(run_dir / "summary.json", summary)
    return RunOutcome(
        run_dir=run_dir, summary=summary, complete=reason is None, interrupted_reason=reason
    )
