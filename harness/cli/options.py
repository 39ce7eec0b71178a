"""Options shared by `bench run` and `bench capacity` (one definition, so they cannot drift)."""

from __future__ import annotations

import click


class EndpointChoice(click.ParamType):
    """An `Endpoint` by name, also spelled as a path under the base URL, as vLLM's
    `--endpoint /v1/completions` does."""

    name = "endpoint"

    def convert(self, value, param, ctx):
        from slo.runrecord import Endpoint  # here, so `bench --help` imports no numpy

        if isinstance(value, Endpoint):
            return value
        text = str(value).strip().rstrip("/").removeprefix("/").removeprefix("v1/")
        for endpoint in Endpoint:
            if text in (endpoint.value, endpoint.path.removeprefix("/")):
                return endpoint
        known = ", ".join(f"{e.value} ({'/v1' + e.path})" for e in Endpoint)
        self.fail(f"{value!r} is not an endpoint here; use one of {known}.", param, ctx)


_SHARED = (
    click.option(
        "--url",
        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1. Without it, the reference engine is started on loopback.",
    ),
    click.option(
        "--model",
        help="Model name to request (default: the target's first model; for the managed engine, smollm2-135m).",
    ),
    click.option(
        "--endpoint",
        type=EndpointChoice(),
        help="API to drive: completions, chat, responses (OpenAI Responses), messages (Anthropic Messages), embeddings or rerank (or vLLM's paths such as /v1/chat/completions); default: the workload's own, else completions.",
    ),
    click.option(
        "--workload",
        help="Built-in workload name or a workload file (YAML spec or built .parquet). Default: random.",
    ),
    click.option("--num-requests", type=int, help="Number of measured requests."),
    click.option(
        "--duration",
        "duration_s",
        type=float,
        help="Stop dispatching after this many seconds, then drain.",
    ),
    click.option(
        "--burstiness", type=float, help="Gamma shape of inter-arrival gaps (1 = Poisson)."
    ),
    click.option(
        "--input-len", type=int, help="Prompt tokens per request (fixed-length workloads)."
    ),
    click.option("--output-len", type=int, help="Output tokens per request (max_tokens)."),
    click.option(
        "--batch-size",
        help="Embeddings and rerank: texts per request (inputs, or documents beside the query), "
        "a whole number or a length distribution such as '{dist: uniform, low: 1, high: 8}'; default 1.",
    ),
    click.option(
        "--ignore-eos/--no-ignore-eos",
        default=None,
        help="Ask the server to generate exactly max_tokens.",
    ),
    click.option(
        "--seed",
        type=int,
        help="Seed for lengths, arrivals and prompts (default: the workload's own seed).",
    ),
    click.option("--timeout", "timeout_s", type=float, help="Per-request timeout in seconds."),
    click.option(
        "--tokenizer",
        help="Tokenizer for token counts: reference model name, GGUF path or HF directory.",
    ),
    click.option(
        "--api-key",
        envvar="OPENAI_API_KEY",
        help="Bearer token for the target (default: $OPENAI_API_KEY); never written to the run directory.",
    ),
    click.option(
        "--session-header",
        help="Multi-turn workloads: send each turn's session id in this HTTP header (session "
        "affinity for a router), e.g. x-session-id.",
    ),
    click.option(
        "--server-arg",
        "server_args",
        multiple=True,
        help="Extra argument for the managed reference server (repeatable).",
    ),
)


def target_and_workload_options(command):
    """Add the target, workload and client options every load-driving command takes."""
    for option in reversed(_SHARED):
        command = option(command)
    return command
