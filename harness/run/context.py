"""One run's state while it is driven (`RunContext`) and the error limits that stop a run
that only measures failures (`ErrorLimits`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from harness.http.client import ClientOptions, RawResult
from harness.load.loadgen import LoadPlan
from harness.load.output_checks import OutputChecks
from harness.load.prompt_watch import PromptTokenWatch
from harness.load.recorder import RunRecorder
from harness.load.records import RecordContext
from harness.run.config import RunConfig
from harness.run.energy import EnergyMeter
from harness.run.extensions import RecordSink, RecordSinkFactory
from harness.run.outcome import server_exit_sentence
from harness.targets.process import ServerProcess, log_tail
from harness.targets.scraper import MetricsScraper
from slo.runrecord import RequestStatus, RunManifest

# How long a stop that lets the requests in flight finish (see `request_stop`) waits for them.
DRAIN_GRACE_S = 5.0
NOT_FOUND = 404
SERVER_LOG_LINES = 5  # of a dead managed server's log, in the sentence that names its exit


def warn(console: Console | None, sentence: str) -> None:
    """One warning sentence on `console`, when there is one."""
    if console is not None:
        console.print(
            f"warning: {sentence}", style="yellow", markup=False, highlight=False, soft_wrap=True
        )


@dataclass
class RunContext:
    """One run's state while it is driven: what to send, where to record it, how to show it.

    Built once, with everything the run needs (`harness.run.plan.plan_run`); what changes
    afterwards is the run's own state. `start(t0_ns)` opens the recorder when the measured
    phase begins; results that finish before that (warm-up) wait in `early`. `close` always
    leaves a readable run directory. It is also a load observer (`on_sent`, `on_done`): it
    keeps the requests in flight, so a stop can let them finish. The first request answered
    (any HTTP status) with 404 stops the run: a wrong URL or model would fail every request
    the same way. `server` is the process the harness manages, if any (`server_death` names
    its exit when it died). It is the `harness.load.services.DrivenRun` the load drivers feed.
    `sink_factory` (an extension's, such as the OTLP push) makes the sink that sees every
    flush's measured records; `close` closes it after the last flush and records its
    manifest sections.
    """

    config: RunConfig
    options: ClientOptions
    plan: LoadPlan
    run_dir: Path
    manifest: RunManifest
    input_tokens: dict[str, int]
    tokenizer: object
    scraper: MetricsScraper
    errors: ErrorLimits
    checks: OutputChecks | None = None
    watch: PromptTokenWatch | None = None
    sessions: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (session, turn)
    classes: dict[str, tuple] = field(default_factory=dict)  # id -> (priority, deadline, tenant)
    batch_sizes: dict[str, int] | None = None  # id -> texts sent (embeddings, rerank)
    server: ServerProcess | None = None
    console: Console | None = None
    quiet: bool = True
    sink_factory: RecordSinkFactory | None = None  # an extension's record sink (OTLP push)
    recorder: RunRecorder | None = field(default=None, init=False)
    sink: RecordSink | None = field(default=None, init=False)
    energy: EnergyMeter = field(default_factory=EnergyMeter.open, init=False)
    early: list[RawResult] = field(default_factory=list, init=False)
    task: asyncio.Task | None = field(default=None, init=False)  # cancelled by a stop
    stop_reason: str | None = field(default=None, init=False)
    in_flight: set[str] = field(default_factory=set, init=False)  # sent and not yet done
    first_http_status: int | None = field(default=None, init=False)  # warm-up included
    _awaited: set[str] | None = field(default=None, init=False)  # a draining stop waits for
    _drain_timer: asyncio.TimerHandle | None = field(default=None, init=False)
    _cancelled: bool = field(default=False, init=False)

    @property
    def t0_ns(self) -> int | None:
        return self.recorder.context.t0_ns if self.recorder is not None else None

    @property
    def flush_interval_s(self) -> float:
        return self.config.recording.flush_interval_s

    @property
    def watches_server(self) -> bool:
        return self.server is not None

    def bind_task(self, task: asyncio.Task) -> None:
        """`task` drives the load: a stop of the run cancels it."""
        self.task = task

    def start(self, t0_ns: int) -> None:
        self.energy.begin()
        context = RecordContext(
            t0_ns=t0_ns,
            is_chat=self.options.is_chat,
            count_tokens=lambda text: len(self.tokenizer.encode(text)),
            checks=self.checks,
            endpoint=self.options.endpoint,
            batch_sizes=self.batch_sizes,
        )
        self.manifest = self.manifest.evolve(t0_ns=t0_ns)
        if self.sink_factory is not None:
            self.sink = self.sink_factory(self.manifest, self.run_dir)
        self.recorder = RunRecorder(
            self.run_dir,
            context,
            self.input_tokens,
            self.manifest,
            on_records=self.watch.observe if self.watch is not None else None,
            sessions=self.sessions,
            classes=self.classes,
            on_batch=self.sink.add if self.sink is not None else None,
        )
        plan = self.plan
        arrivals = plan.arrival_s if plan.arrival_s is not None else [None] * len(plan.payloads)
        self.recorder.writer.write_schedule(
            [(p.request_id, None, True) for p in plan.warmup]
            + [(rid, a, False) for rid, a in zip(plan.request_ids(), arrivals, strict=True)]
        )
        for raw in self.early:
            self.recorder.add(raw)
        self.early.clear()

    def on_result(self, raw: RawResult) -> None:
        if self.recorder is None:
            self.early.append(raw)
        else:
            self.recorder.add(raw)
        if self.first_http_status is None and raw.http_status is not None:
            self.first_http_status = raw.http_status
            if raw.http_status == NOT_FOUND:
                # the requests already out went to the same URL: let their 404s come back
                self.request_stop(
                    f"the first request answered got HTTP 404 from POST {self.options.url}",
                    let_in_flight_finish=True,
                )
        if not raw.is_warmup and self.stop_reason is None:
            reason = self.errors.observe(raw)
            if reason is not None:
                self.request_stop(reason)

    def on_sent(self, raw: RawResult) -> None:
        self.in_flight.add(raw.request_id)

    def on_done(self, raw: RawResult) -> None:
        self.in_flight.discard(raw.request_id)
        if self._awaited is not None:
            self._awaited.discard(raw.request_id)
            if not self._awaited:
                self._cancel()

    def request_stop(self, reason: str, *, let_in_flight_finish: bool = False) -> None:
        """Stop the run early for `reason` (judged like the error limits: exit 3); the first
        reason given is kept. Requests not yet sent are recorded `not_sent`; those in flight
        are cancelled, or with `let_in_flight_finish` waited for (at most DRAIN_GRACE_S; a
        request sent meanwhile is not waited for)."""
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        if let_in_flight_finish and self.in_flight and self.task is not None:
            self._awaited = set(self.in_flight)
            self._drain_timer = self.task.get_loop().call_later(DRAIN_GRACE_S, self._cancel)
        else:
            self._cancel()

    def _cancel(self) -> None:
        # Once only: a second cancel would interrupt the load loop's own clean-up, which
        # records the in-flight requests as cancelled and the unsent ones as not_sent.
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if not self._cancelled and self.task is not None:
            self._cancelled = True
            self.task.cancel()

    def server_death(self) -> str | None:
        """The sentence naming the managed server's exit (how, when, its log's last lines)
        when its process ended without the harness asking; None while it runs, or without
        one. A fault plan's `kill_engine` ends it on purpose and is not a death."""
        if self.server is None:
            return None
        code = self.server.unexpected_exit()
        if code is None:
            return None
        t0 = self.t0_ns
        elapsed_s = None if t0 is None else (time.perf_counter_ns() - t0) / 1e9
        path = Path(self.server.log_path)
        lines = [line.strip()[:200] for line in log_tail(path).splitlines() if line.strip()]
        return server_exit_sentence(
            self.server.name, code, elapsed_s, path.name, lines[-SERVER_LOG_LINES:]
        )

    def warn(self, sentence: str) -> None:
        """One warning sentence on the console (nothing for library callers without one)."""
        warn(self.console, sentence)

    def flush(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()

    def record_in_manifest(self, **sections) -> None:
        """Record manifest sections (a transport layer's, such as the fault plan and the
        windows it applied); written when the run closes."""
        self.manifest = self.manifest.evolve(**sections)
        if self.recorder is not None:
            self.recorder.writer.manifest = self.recorder.writer.manifest.evolve(**sections)

    def end_energy(self) -> None:
        """Read the energy counters at the end of the load into the manifest (the first call
        counts: `close` calls it too, after the settle)."""
        self.record_in_manifest(energy=self.energy.end().to_dict())

    def close(self, reason: str | None, server_state: dict | None = None) -> None:
        if self.recorder is None:  # stopped during warm-up: still leave a readable run
            self.start(time.perf_counter_ns())
        self.end_energy()
        scraped = self.scraper.write(self.run_dir)
        self.recorder.close(
            complete=reason is None,
            reason=reason,
            server_metrics_samples=scraped,
            server_state=server_state,
            **self.close_sink(complete=reason is None),
        )

    def close_sink(self, *, complete: bool) -> dict:
        """Hand the sink the last records and close it; its manifest sections (say its
        warning). Nothing without a sink."""
        if self.sink is None:
            return {}
        self.recorder.flush()
        self.sink.close(complete=complete)
        if (sentence := self.sink.warning()) is not None:
            self.warn(sentence)
        return self.sink.manifest_changes()


@dataclass
class ErrorLimits:
    """`--max-error-rate` and `--max-consecutive-errors`: stop a run that only measures
    failures. The rate is judged once `min_requests` results are in; requests the client
    cancelled itself are left out of both counts."""

    max_error_rate: float | None = None
    max_consecutive: int | None = None
    min_requests: int = 20
    done: int = 0
    failed: int = 0
    consecutive: int = 0

    def observe(self, raw: RawResult) -> str | None:
        """Count one result; the reason to stop, in words, once a limit is passed."""
        if raw.status in (RequestStatus.NOT_SENT, RequestStatus.CANCELLED):
            # A cancellation is the client's own doing (a fault plan's, or Ctrl-C): it says
            # nothing about the target, so it neither fails nor passes the run.
            return None
        self.done += 1
        # The transport sets a status only for outcomes it decided, all of them failures; a
        # stream that parses badly is counted when the recorder parses it, not here.
        if raw.status is not None:
            self.failed += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        last = f"{raw.error_class or raw.status}: {raw.error_message}"
        if self.max_consecutive is not None and self.consecutive >= self.max_consecutive:
            return (
                f"{self.consecutive} requests in a row failed (--max-consecutive-errors "
                f"{self.max_consecutive}); the last: {last}"
            )
        rate = self.failed / self.done
        if (
            self.max_error_rate is not None
            and self.done >= self.min_requests
            and rate > self.max_error_rate
        ):
            return (
                f"{self.failed} of {self.done} requests failed ({rate:.0%}, above "
                f"--max-error-rate {self.max_error_rate:g}); the last: {last}"
            )
        return None
