"""`serve`: run the reference engine's OpenAI-compatible server (a thin click layer).

Engine options are generated from `EngineConfig`'s fields, so their defaults live in the
dataclass alone: an option left unset is not passed, and the dataclass default applies.
`enable_*` booleans become `--enable-x/--disable-x`; `*_bytes` sizes accept suffixes
(`512MiB`, `2GB`); a nested config (`--speculative-config`) is a JSON object, as in vLLM;
everything else keeps its field name with dashes. The server's own options
(`--api-key`, the limits) work the same way over `ServerConfig`: unset, its default applies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
import sys
import typing
from pathlib import Path
from typing import Any

import click

from engine_ref.loading.model_files import ModelFileError
from engine_ref.serving.engine_loop import ENGINE_LOOP_MODES, EngineLoopError
from engine_ref.serving.interface import (
    ENGINE_CHOICES,
    EngineConfig,
    EngineConfigError,
    isa_env_problem,
)
from engine_ref.serving.reasoning import REASONING_PARSERS
from engine_ref.serving.server import ServerConfig, ServerError
from engine_ref.serving.server import serve as run_server

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def _run_event_loop(main: Any) -> None:
    """Run `main` on uvloop where it is installed (faster socket and SSE writes), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


class ByteSize(click.ParamType):
    """An integer number of bytes, optionally with a unit: 1073741824, 1GiB, 512MB."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            self.fail(f"{value!r} is not a size such as 1073741824, 512MiB or 1GiB.", param, ctx)
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _server_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(ServerConfig) if f.name == name)


# ServerConfig fields with an option each: (field, option declarations, type, help).
_SERVER_OPTIONS = (
    (
        "api_key",
        ["--api-key"],
        str,
        "Require `Authorization: Bearer KEY` on every /v1/* route (/health, /metrics and "
        "/info stay open, as in vLLM).",
    ),
    (
        "enable_prompt_tokens_details",
        ["--enable-prompt-tokens-details"],
        None,
        "Report usage.prompt_tokens_details.cached_tokens (prompt tokens served from the "
        "prefix cache).",
    ),
    (
        "enable_fault_injection",
        ["--enable-fault-injection"],
        None,
        'Add POST /admin/step_delay {"delay_ms": N}: every engine step N ms slower (for '
        "bench run --faults; never on a shared server).",
    ),
    (
        "reasoning_parser",
        ["--reasoning-parser"],
        click.Choice(REASONING_PARSERS),
        "Chat outputs: text between <think> and </think> goes to reasoning_content, the rest "
        "to content; usage gains completion_tokens_details.reasoning_tokens.",
    ),
    (
        "max_body_bytes",
        ["--max-body-bytes"],
        ByteSize(),
        "Largest request body; larger ones get 413.",
    ),
    (
        "max_prompt_chars",
        ["--max-prompt-chars"],
        click.IntRange(min=1),
        "Most prompt characters per request (all prompts or messages); more get 400 before "
        "tokenizing.",
    ),
    (
        "header_timeout_s",
        ["--header-timeout"],
        click.FloatRange(min=0, min_open=True),
        "Seconds a connection has to send a complete request head (slowloris guard).",
    ),
    (
        "stream_write_timeout_s",
        ["--stream-write-timeout"],
        click.FloatRange(min=0, min_open=True),
        "Seconds a stream may wait on a client that stopped reading before it is aborted.",
    ),
    (
        "max_stream_backlog",
        ["--max-stream-backlog"],
        click.IntRange(min=1),
        "Engine outputs (per prompt) a stream may fall behind its client before it is aborted.",
    ),
)


def _server_options(command: Any) -> Any:
    """Decorate `command` with one option per entry of _SERVER_OPTIONS."""
    for name, decls, kind, help_text in reversed(_SERVER_OPTIONS):
        default = _server_default(name)
        shown = "none" if name == "api_key" else default
        text = f"{help_text} (default: {shown})"
        if kind is None:  # a flag
            option = click.option(*decls, name, is_flag=True, default=None, help=text)
        else:
            option = click.option(*decls, name, type=kind, default=None, help=text)
        command = option(command)
    return command


def _engine_options(command: Any) -> Any:
    """Decorate `command` with one option per EngineConfig field."""
    hints = typing.get_type_hints(EngineConfig)
    for f in reversed(dataclasses.fields(EngineConfig)):
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        flag = f.name.replace("_", "-")
        help_text = f"EngineConfig.{f.name} (default: {f.default})"
        if f.name in ENGINE_CHOICES:
            help_text = (
                f"EngineConfig.{f.name}: {', '.join(ENGINE_CHOICES[f.name])} (default: {f.default})"
            )
        if base is bool and f.name.startswith("enable_"):
            rest = flag[len("enable-") :]
            decls = [f"--enable-{rest}/--disable-{rest}", f.name]
            option = click.option(*decls, default=None, help=help_text)
        elif dataclasses.is_dataclass(base):  # speculative_config: JSON, as vLLM takes it
            example = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'
            help_text = f"EngineConfig.{f.name} as a JSON object, e.g. '{example}' (default: none)"
            option = click.option(f"--{flag}", f.name, type=str, default=None, help=help_text)
        elif f.name.endswith("_bytes"):
            decls = [f"--{flag}", f"--{flag[: -len('-bytes')]}", f.name]
            option = click.option(*decls, type=ByteSize(), default=None, help=help_text)
        else:
            option = click.option(f"--{flag}", f.name, type=base, default=None, help=help_text)
        command = option(command)
    return command


@click.command("serve")
@_engine_options
@_server_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port; 0 picks a free one.")
@click.option(
    "--port-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the bound port to this file once listening.",
)
@click.option(
    "--engine-loop",
    type=click.Choice(ENGINE_LOOP_MODES),
    default="thread",
    show_default=True,
    help="Run the engine in a thread or in a separate process.",
)
@click.option(
    "--served-model-name", default=None, help="Model id clients must send (default: --model)."
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning"]),
    default="info",
    show_default=True,
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker servers behind a router (engine_ref.cluster); 1 serves one engine directly. "
    "Every other option applies to each worker.",
)
@click.option(
    "--router",
    default=None,
    help="With --replicas 2 or more, how the router picks a worker: round-robin (default), "
    "least-loaded or prefix-affinity.",
)
@click.option(
    "--prefill-workers",
    type=click.IntRange(min=1),
    default=None,
    help="P/D mode, with --decode-workers: workers that prefill each request and hand its KV "
    "to a decode worker (engine_ref.cluster.pd); not with --replicas.",
)
@click.option(
    "--decode-workers",
    type=click.IntRange(min=1),
    default=None,
    help="P/D mode, with --prefill-workers: workers that decode from handed-off KV.",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="With --replicas 2 or more, or P/D workers: start the workers as Ray actors on the "
    "Ray cluster at ADDRESS, one CPU each (`local` starts one here; needs the ray extra).",
)
def serve(
    host: str,
    port: int,
    port_file: Path | None,
    engine_loop: str,
    served_model_name: str | None,
    log_level: str,
    replicas: int,
    router: str | None,
    prefill_workers: int | None,
    decode_workers: int | None,
    ray_address: str | None,
    **options: Any,
) -> None:
    """Serve the reference engine over an OpenAI-compatible HTTP API until interrupted:
    POST /v1/completions, /v1/chat/completions, /v1/responses (OpenAI Responses API) and
    /v1/messages (Anthropic Messages API), streamed or not; GET /v1/models, /health,
    /metrics, /info.

    Chat tools: tool_choice "required" or a named function constrains the output to valid
    calls through the grammar path (needs xgrammar) and answers with tool_calls; "auto" (the
    default) and "none" ignore the tools and answer in text (no free-form tool-call parser).

    Prints "listening on http://HOST:PORT" once the port is bound."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    server_names = {name for name, *_ in _SERVER_OPTIONS}
    given = {k: v for k, v in options.items() if v is not None}
    try:
        engine = EngineConfig(**{k: v for k, v in given.items() if k not in server_names})
        config = ServerConfig(
            engine=engine,
            host=host,
            port=port,
            port_file=port_file,
            engine_loop=engine_loop,
            served_model_name=served_model_name,
            **{k: v for k, v in given.items() if k in server_names},
        )
    except (EngineConfigError, ServerError) as exc:
        raise click.UsageError(str(exc)) from None
    isa_problem = isa_env_problem()  # a typo would silently run torch's kernels
    if isa_problem is not None:
        raise click.UsageError(isa_problem)

    def announce(url: str) -> None:
        click.echo(f"listening on {url}")
        sys.stdout.flush()

    pd = prefill_workers is not None or decode_workers is not None
    if pd and (prefill_workers is None or decode_workers is None):
        raise click.UsageError("P/D mode needs both --prefill-workers and --decode-workers.")
    if pd and (replicas > 1 or router is not None):
        raise click.UsageError(
            "--prefill-workers/--decode-workers replace --replicas and --router."
        )
    if pd and engine_loop != "thread":
        raise click.UsageError("P/D workers run the engine in thread mode (--engine-loop thread).")
    if router is not None and replicas < 2:
        raise click.UsageError("--router needs --replicas 2 or more.")
    if ray_address is not None and replicas < 2 and not pd:
        raise click.UsageError("--ray needs --replicas 2 or more, or P/D workers.")
    if replicas >= 2:
        from engine_ref.cluster.routing import POLICIES  # the cluster loads only when used

        router = router or POLICIES[0]
        if router not in POLICIES:
            raise click.UsageError(f"Unknown --router {router!r}; known: {', '.join(POLICIES)}.")

    async def until_signalled() -> None:
        # SIGINT and SIGTERM stop the server cleanly, so an engine process never outlives it.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        if pd:
            from engine_ref.cluster.pd import serve_pd_cluster

            await serve_pd_cluster(
                config, prefill_workers=prefill_workers, decode_workers=decode_workers,
                log_level=log_level, on_listening=announce, stop=stop, ray_address=ray_address,
            )  # fmt: skip
            return
        if replicas >= 2:
            from engine_ref.cluster.router import serve_cluster

            await serve_cluster(
                config, replicas=replicas, policy=router, log_level=log_level,
                on_listening=announce, stop=stop, ray_address=ray_address,
            )  # fmt: skip
            return
        await run_server(config, on_listening=announce, stop=stop)

    try:
        _run_event_loop(until_signalled())
    except (ServerError, EngineLoopError, EngineConfigError, ModelFileError) as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
