"""The `bench` command line: a thin layer over the library; defaults live in the config dataclasses."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from harness.cli.options import target_and_workload_options
from harness.cli.targets import run_comparative_command, target_options
from harness.cli.vllm_compat import VllmCompatCommand, save_result, translate, vllm_options
from harness.errors import HarnessError

if TYPE_CHECKING:  # a type only: `bench --help` imports no pyarrow
    from slo.runrecord import RunSummary

EXAMPLES = """
\b
Examples:
  bench run --workload sharegpt --slo p99.yaml            # reference engine, started for you
  bench run --url http://127.0.0.1:8000/v1 --workload random \\
            --input-len 128 --output-len 128 --num-requests 64 --request-rate inf
  bench run --url http://127.0.0.1:8000/v1 --concurrency 16 --num-requests 200   # closed loop
  bench mock-server --port 8001 --ttft-ms 50 --itl-ms 10
  bench workload list
  bench report runs/A runs/B -o card.html
  bench compare runs/base runs/cand --gate
"""

# Subcommands other packages own: (module, attribute, one-line help). They are imported only
# when used, so `bench --help` stays fast (no torch import).
LAZY_COMMANDS = {
    "workload": ("workloads.cli", "workload", "List, show and build workloads."),
    "serve": (
        "engine_ref.serving.cli_serve",
        "serve",
        "Serve the reference engine over an OpenAI-compatible API.",
    ),
    "model": (
        "engine_ref.serving.cli_model",
        "model",
        "Fetch, list and export reference-engine models.",
    ),
    "faults": ("faults.cli", "faults", "List and show fault plans."),
    "probe": ("faults.probe_cli", "probe", "Probe a server's robustness (bad-input)."),
    "report": ("reports.cli", "report", "Write a report card (HTML/JSON) for one or more runs."),
    "compare": (
        "reports.cli",
        "compare",
        "Compare a candidate run with a baseline; --gate for CI.",
    ),
    "export": ("reports.cli_export", "export", "Export a run as vLLM JSON, llm-d report or CSV."),
    "history": (
        "reports.history.cli",
        "history",
        "A run history: add runs, show trends, gate a run against recent runs.",
    ),
    "sweep": (
        "harness.cli.sweep",
        "sweep",
        "Run several request rates or concurrencies; sweep card.",
    ),
    "capacity": (
        "harness.cli.capacity",
        "capacity",
        "Find the highest request rate that meets an SLO.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS:
            module, attr, _ = LAZY_COMMANDS[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        rows = [
            (name, self.commands[name].get_short_help_str(60))
            for name in super().list_commands(ctx)
        ]
        rows += [(name, entry[2]) for name, entry in LAZY_COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))


@click.group(
    cls=LazyGroup, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(package_name="llm-bench-harness")
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmark and reliability harness for LLM serving engines."""
    # `bench workload build --tokenizer NAME` resolves reference-engine tokenizers through this,
    # so `workloads` never imports `engine_ref` itself.
    ctx.ensure_object(dict)["load_tokenizer"] = _load_tokenizer


def _load_tokenizer(name: str):
    from engine_ref.loading import load_tokenizer

    return load_tokenizer(name)


def _drop_none(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


@bench.command(epilog=EXAMPLES, cls=VllmCompatCommand)
@target_and_workload_options
@target_options
@click.option("--request-rate", type=float, help="Requests per second; inf sends all at once.")
@click.option(
    "--concurrency",
    type=int,
    help="Closed loop with this many users; with --request-rate, a cap on in-flight requests.",
)
@click.option(
    "--range-ratio",
    type=float,
    help="Uniform length spread around --input-len/--output-len, as vLLM's --random-range-ratio.",
)
@click.option(
    "--dataset-path",
    help="Dataset or trace file for workloads that read one (e.g. a ShareGPT JSON).",
)
@click.option(
    "--warmup", type=int, help="Requests sent before the measured phase, excluded from metrics."
)
@click.option(
    "--out", type=click.Path(path_type=Path), help="Run directory (default runs/<time>-<workload>)."
)
@click.option("--slo", help="SLO spec: built-in name (p99, interactive) or a YAML file.")
@click.option("--no-stream", is_flag=True, help="Use non-streaming requests.")
@click.option(
    "--chunk-usage/--no-chunk-usage",
    default=None,
    help="Ask for the usage so far in every stream chunk (vLLM's "
    "stream_options.continuous_usage_stats), so each chunk's tokens are the server's count. "
    "Default: on for the reference engine and vLLM, off for other targets.",
)
@click.option("--quiet", is_flag=True, help="No progress bar or summary table (for CI).")
@click.option(
    "--faults",
    help="Fault plan: built-in name or YAML file (bench faults list); injected while measuring.",
)
@click.option(
    "--max-error-rate",
    type=float,
    help="Stop the run (exit 3) once more than this fraction of requests failed (judged after 20).",
)
@click.option(
    "--max-consecutive-errors",
    type=int,
    help="Stop the run (exit 3) after this many failed requests in a row.",
)
@click.option(
    "--stop-on-saturation",
    is_flag=True,
    default=None,
    help="Stop the run (exit 3) once TTFT and the requests in flight keep rising together: "
    "the target cannot keep up (the card's over-saturation rule, judged live).",
)
@click.option(
    "--workers",
    metavar="N|auto",
    help="Split the schedule across N local worker processes (each its own event loop and "
    "connection pool; all recorded into one run directory), or 'auto': one per ~600k "
    "expected output tokens/s (closed loop: per 64 users), at most cores - 1. With --ray: "
    "the number of Ray actors (default one per node).",
)
@click.option(
    "--on-worker-failure",
    type=click.Choice(["continue", "stop"]),
    help="A worker that dies mid-run: its in-flight requests are unknown, its unsent ones "
    "not_sent; continue (default) lets the others run on, stop cancels them.",
)
@click.option(
    "--ray",
    "ray_address",
    metavar="ADDRESS",
    help="Run the workers as Ray actors spread across a cluster's nodes (auto, local or "
    "host:port; pip install 'llm-bench-harness[ray]'); per-node clock offsets are recorded.",
)
@click.option(
    "--cost-per-hour",
    type=float,
    metavar="USD",
    help="What the target costs, US dollars an hour: the card adds the cost per million output "
    "tokens at the SLO (good requests' tokens) and per million of all output tokens.",
)
@click.option(
    "--memory-budget-mb",
    type=float,
    metavar="MB",
    help="What the summary and the card may hold of the run's chunks (default 512): pooled "
    "chunk gaps (ITL) are exact while they fit, else a quantile sketch within 1% relative "
    "error; the summary and the card say which.",
)
@click.option(
    "--otlp",
    metavar="URL",
    help="Push each request's span (and the run's root span at the end) to this OTLP/HTTP "
    "collector while the run runs (POST URL/v1/traces, JSON; the spans bench export "
    "--format otlp-json writes). A slow or absent collector never slows or fails the run: "
    "spans that do not fit are dropped and counted in the manifest.",
)
@click.option(
    "--otlp-header",
    "otlp_headers",
    multiple=True,
    metavar="'NAME: VALUE'",
    help="A header for every --otlp POST (a collector's token); repeatable; never recorded.",
)
@vllm_options
def run(quiet: bool, no_stream: bool, server_args: tuple[str, ...], **kwargs) -> None:
    """Drive a target with a workload, record every request and chunk, and summarise.

    vLLM's `bench serve` flags are accepted with vLLM's meaning (listed last)."""
    from harness.cli.compose import run_extensions
    from harness.run.config import RunConfig
    from harness.run.orchestrator import run_benchmark
    from reports.terminal import cli_console

    targets, repeat = kwargs.pop("targets"), kwargs.pop("repeat")
    otlp = _otlp_endpoint(kwargs.pop("otlp"), kwargs.pop("otlp_headers"))
    kwargs["target"] = targets[0] if targets else None
    kwargs, result_request, no_progress = translate(_drop_none(**kwargs))
    config = RunConfig(stream=not no_stream, server_args=server_args, **kwargs)
    console = cli_console()
    quiet = quiet or no_progress
    extensions = run_extensions(config, otlp)
    if len(targets) > 1 or repeat != 1:
        targets = targets or (config.server.spec.text,)
        sys.exit(run_comparative_command(config, targets, repeat, console, quiet, extensions))
    outcome = run_benchmark(config, console=console, quiet=quiet, extensions=extensions)
    if result_request is not None:
        click.echo(f"vLLM result: {save_result(result_request, outcome.run_dir)}")
    if not quiet:
        _render(outcome.summary, outcome.run_dir, console)
    verdict = outcome.verdict
    if verdict.sentence:
        click.echo(verdict.sentence, err=True)
    if outcome.complete:
        click.echo(f"run directory: {outcome.run_dir}")
    elif not outcome.stopped_by_errors:
        click.echo(
            f"run stopped early ({outcome.interrupted_reason}); what was recorded is in {outcome.run_dir}, marked incomplete.",
            err=True,
        )
    else:
        click.echo(f"what was recorded is in {outcome.run_dir}, marked incomplete.", err=True)
    sys.exit(verdict.exit_code)


def _otlp_endpoint(url: str | None, headers: tuple[str, ...]):
    """`--otlp` and its headers checked before anything runs (one sentence when bad)."""
    if url is None:
        if headers:
            raise HarnessError("--otlp-header is sent with --otlp only; give --otlp URL too.")
        return None
    from reports.exports.otlp_live import parse_endpoint

    return parse_endpoint(url, headers)


def _render(summary: RunSummary, run_dir: Path, console) -> None:
    try:
        from reports.console import render_summary
    except ImportError:  # no reports: the headline blocks as JSON
        console.print_json(
            data=dict(
                counts=summary.counts.to_dict(),
                throughput=summary.throughput.to_dict(),
                latency_ms=summary.latency_ms.to_dict(),
            )
        )
        return
    render_summary(summary, console, run_dir=run_dir)


@bench.command("mock-server")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=0, show_default=True, help="0 picks a free port.")
@click.option("--ttft-ms", type=float)
@click.option("--itl-ms", type=float)
@click.option("--jitter-sigma", type=float, help="Lognormal sigma applied to TTFT and each ITL.")
@click.option("--output-len", type=int, help="Fixed output length (default: honour max_tokens).")
@click.option(
    "--max-concurrency",
    type=int,
    help="Service slots; the server saturates at slots / service time.",
)
@click.option("--error-rate", type=float)
@click.option("--reject-rate", type=float)
@click.option("--reset-rate", type=float)
@click.option("--incomplete-rate", type=float)
@click.option("--malformed-sse-rate", type=float)
@click.option("--malformed-json-rate", type=float)
@click.option("--stall-rate", type=float)
@click.option("--stall-s", type=float)
@click.option("--seed", type=int)
@click.option("--model")
@click.option("--no-usage", "usage", flag_value=False, default=None, help="Never report usage.")
@click.option("--api-key", help="Answer 401 to generation requests without this bearer token.")
@click.option(
    "--metrics", is_flag=True, default=None, help="Serve /metrics (running, waiting, KV gauges)."
)
@click.option(
    "--leak-on-cancel",
    is_flag=True,
    default=None,
    help="Never release a request whose client left (to test leak checks).",
)
@click.option(
    "--tool-calls",
    type=click.Choice(["valid", "bad_json", "unknown_function"]),
    help="Answer chat requests that offer tools with one call: valid, or malformed.",
)
def mock_server(host: str, port: int, **kwargs) -> None:
    """Serve a mock OpenAI-compatible engine with configurable latency and failures."""
    import asyncio

    from harness.targets.mock_server import MockConfig, start_mock

    try:
        config = MockConfig(**_drop_none(**kwargs))
    except ValueError as exc:
        raise HarnessError(f"{exc}.") from exc

    async def serve() -> None:
        runner, url = await start_mock(config, host, port)
        click.echo(f"listening on {url.removesuffix('/v1')}", err=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    from harness.load.services import run_event_loop

    try:
        run_event_loop(serve())
    except KeyboardInterrupt:
        pass


# Exceptions that mean "the user asked for something impossible": (module, class name).
USER_ERRORS = (
    ("harness.errors", "HarnessError"),
    ("workloads", "WorkloadError"),
    ("slo", "SLOError"),
    ("reports", "ReportError"),
    ("engine_ref.loading.model_files", "ModelFileError"),
    ("slo.runrecord.errors", "RunRecordError"),
    ("faults.plan", "FaultPlanError"),
)


def _is_user_error(exc: BaseException) -> bool:
    # Only modules already imported can have raised their error, so nothing is imported here.
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def main() -> None:
    """Entry point: user errors end in one sentence and exit code 2, never a traceback."""
    # Arrow's tables in the C library's malloc, unless the user names a pool: its default
    # (mimalloc) keeps what a run's tables freed, so a run's peak grew with its length (bench
    # run against the mock, 1,024-token streams, one core, peak RSS at 30,000 requests: 321-328
    # MB with mimalloc, 292-293 MB with this; 15,000: 287 MB). Read when pyarrow loads, which
    # `bench` does only after this point; setting the pool at run time left half the gain.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    try:
        bench.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
