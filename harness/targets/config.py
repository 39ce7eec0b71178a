"""The run configuration's target part: what a run drives, how the harness starts it when it
manages it, and how every request reaches it."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import HarnessError, check_positive
from harness.targets.engines import parse_assignments
from harness.targets.spec import TargetSpec
from slo.runrecord import Endpoint

# Body fields the harness sets from the workload and the run; `--extra-body` may not replace them.
RESERVED_BODY_FIELDS = ("model", "prompt", "messages", "max_tokens", "stream", "stream_options")


def check_extra_body(extra_body) -> None:
    """Refuse an `--extra-body` that is not a JSON object or that replaces a reserved field."""
    if not isinstance(extra_body, dict):
        raise HarnessError(f"--extra-body must be a JSON object, got {type(extra_body).__name__}.")
    clash = sorted(set(extra_body) & set(RESERVED_BODY_FIELDS))
    if clash:
        raise HarnessError(
            f"--extra-body may not set {clash[0]!r}: the harness sets it from the workload "
            "(use --model, --output-len or --no-stream instead)."
        )


@dataclass(frozen=True)
class TargetConfig:
    """The target part of `harness.run.config.RunConfig`.

    - `spec`: what to drive (`--target`, `--url`; see `TargetSpec`). A managed target is
      started on loopback with `model` (default `smollm2-135m`), `server_args` (the reference
      engine's) or the `engine_commands`/`engine_pythons` overrides (`ENGINE=TEMPLATE`,
      `ENGINE=PATH`, see `harness.targets.engines`), and has `startup_timeout_s` to answer.
    - `endpoint`: None means the workload's own, else completions; `stream`, `timeout_s`
      (per request: a request past it is recorded `timeout`).
    - `chunk_usage`: ask for vLLM's `stream_options.continuous_usage_stats` (the usage so far
      in every chunk), so each chunk's token count is the server's; None: on for the
      reference engine and vLLM (which understand it), off for other targets.
    - `api_key`, `headers`: sent with every request ((name, value) pairs; only the names are
      recorded); `extra_body`: a JSON object merged into every request body
      (engine-specific sampling fields such as vLLM's `top_k`).
    - `tokenizer`: counts prompt tokens and, where the server reports no usage, output tokens;
      a reference-engine model name, GGUF path, HF directory or tokenizer.json (default: the
      model under test; see `harness.targets.tokenizer_choice`).
    """

    spec: TargetSpec = TargetSpec()
    model: str | None = None
    endpoint: Endpoint | None = None
    stream: bool = True
    chunk_usage: bool | None = None
    timeout_s: float = 600.0
    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    extra_body: dict | None = None
    tokenizer: str | None = None
    server_args: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    engine_commands: tuple[str, ...] = ()
    engine_pythons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_positive("timeout_s", self.timeout_s)
        if self.endpoint is not None:
            if self.endpoint not in set(Endpoint):
                names = ", ".join(e.value for e in Endpoint)
                raise HarnessError(f"--endpoint must be one of {names}, got {self.endpoint!r}.")
            object.__setattr__(self, "endpoint", Endpoint(self.endpoint))
        if self.extra_body is not None:
            check_extra_body(self.extra_body)
        parse_assignments(self.engine_commands, "--engine-command")
        parse_assignments(self.engine_pythons, "--engine-python")
