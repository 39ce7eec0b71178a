"""The run configuration: built once (from the CLI or a library caller) and passed down."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.errors import HarnessError
from slo.runrecord import Endpoint

# Body fields the harness sets from the workload and the run; `--extra-body` may not replace them.
RESERVED_BODY_FIELDS = ("model", "prompt", "messages", "max_tokens", "stream", "stream_options")


def normalise_base_url(url: str) -> str:
    """The OpenAI base URL for `url`: `http://host:port` (vLLM's `--base-url` form) gets `/v1`.

    A URL with any other path is kept as given (some gateways mount the API elsewhere); a
    trailing slash is dropped. Raises `HarnessError` for a URL that is not http(s)."""
    if not url.startswith(("http://", "https://")):
        raise HarnessError(f"--url must start with http:// or https://, got {url!r}.")
    url = url.rstrip("/")
    _, _, rest = url.partition("://")
    if "/" not in rest:
        return f"{url}/v1"
    return url


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


WORKER_FAILURE_POLICIES = ("continue", "stop")


def parse_workers(value) -> int | str:
    """`--workers`: a whole number of at least 1, or `auto`; anything else is one sentence."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            raise HarnessError(
                f"--workers must be a whole number of at least 1 or auto, got {value!r}."
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HarnessError(
            f"--workers must be a whole number of at least 1 or auto, got {value!r}."
        )
    return value


@dataclass(frozen=True)
class RunConfig:
    """Everything `bench run` needs. `None` for a workload field means the workload's default.

    - `url`: OpenAI-compatible base URL (`http://host:port/v1`); `None` starts the reference
      engine on loopback with `model` (default `smollm2-135m`).
    - `request_rate`: requests/s (`inf`: all at once); with `concurrency` alone the run is
      closed loop with that many users; with both, `concurrency` caps in-flight requests.
    - `warmup`: requests sent before the measured phase and excluded from its metrics.
    - `timeout_s`: per-request limit; a request past it is recorded as `timeout`.
    - `scrape_interval_s`: how often the target's `/metrics` is sampled into
      `server_metrics.parquet` (0: never; targets without `/metrics` are skipped).
    - `client_bound_ms`: dispatch-lag p99 above this marks the run `client_bound`.
    - `tokenizer`: counts prompt tokens and, where the server reports no usage, output tokens;
      a reference-engine model name, GGUF path, HF directory or tokenizer.json (default: the
      model under test; see `harness.tokenizer_choice`).
    - `headers`: (name, value) pairs sent with every request; only the names are recorded.
    - `chunk_usage`: ask for vLLM's `stream_options.continuous_usage_stats` (the usage so far
      in every chunk), so each chunk's token count is the server's; None: on for the
      reference engine and vLLM (which understand it), off for other targets.
    - `extra_body`: a JSON object merged into every request body (engine-specific sampling
      fields such as vLLM's `top_k`, `min_p`, `repetition_penalty`).
    - `workers`: split the schedule across this many local worker processes (`harness.workers`),
      or `"auto"` (from the cores and the expected rate); None: one process (with `ray_address`,
      one Ray actor per node). `ray_address` (`auto`, `local` or host:port) runs the workers
      as Ray actors; `on_worker_failure` (`continue` or `stop`) says what a dead worker does
      to the others.
    - `target`: what to drive (`harness.engines`); `check_outputs` makes requests greedy and
      compares each output with the reference engine's batch-1 output (`harness.oracle`).
    """

    workload: str = "random"
    url: str | None = None
    model: str | None = None
    endpoint: Endpoint | None = None  # None: the workload's own, else completions
    stream: bool = True
    chunk_usage: bool | None = None  # the usage so far in every chunk; None: ref and vLLM only
    num_requests: int | None = None
    duration_s: float | None = None
    request_rate: float | None = None
    burstiness: float | None = None
    concurrency: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    ignore_eos: bool | None = None
    dataset_path: str | None = None
    seed: int | None = None  # None: the workload spec's own seed
    warmup: int = 0
    timeout_s: float = 600.0
    out: Path | None = None
    slo: str | dict | None = None  # a name or file, or a spec dict (`--goodput`)
    tokenizer: str | None = None
    client_bound_ms: float = 10.0
    flush_interval_s: float = 5.0
    scrape_interval_s: float = 1.0  # Prometheus /metrics polling; 0 turns it off
    server_args: tuple[str, ...] = field(default_factory=tuple)
    startup_timeout_s: float = 600.0
    api_key: str | None = None
    max_error_rate: float | None = None  # stop once more than this fraction failed (0-1)
    max_consecutive_errors: int | None = None
    stop_on_saturation: bool = False  # stop once TTFT and in-flight rise together (exit 3)  # stop after this many failures in a row
    settle_s: float = 10.0  # how long to wait for the target to go idle after the run
    faults: str | None = None  # a fault plan: built-in name or YAML file (`bench faults list`)
    headers: tuple[tuple[str, str], ...] = ()  # extra HTTP headers on every request (`--header`)
    extra_body: dict | None = None  # JSON fields merged into every request body (`--extra-body`)
    session_header: str | None = None  # multi-turn: the HTTP header carrying each session id
    slice_duration_s: float | None = None  # fixed-width time slices on the card (s)
    target: str = "ref"  # ref | vllm | llamacpp | url:http://... (`url` wins when set)
    engine_commands: tuple[str, ...] = ()  # ENGINE=TEMPLATE overrides (harness.engines)
    engine_pythons: tuple[str, ...] = ()  # ENGINE=PATH: the interpreter of an engine's venv
    check_outputs: bool = False  # greedy requests, each output compared with the reference
    diverge_before: int = 32  # with check_outputs: diverging before this token is wrong output
    workers: int | str | None = None  # worker processes or Ray actors; "auto"; None: one
    ray_address: str | None = None  # run the workers as Ray actors on this cluster
    on_worker_failure: str = "continue"  # continue | stop: what a dead worker does to the run

    def __post_init__(self) -> None:
        def positive(name: str, value, *, integer: bool = False) -> None:
            if value is None:
                return
            if integer and (isinstance(value, bool) or int(value) != value):
                raise HarnessError(
                    f"--{name.replace('_', '-')} must be a whole number, got {value!r}."
                )
            if not value > 0 or (isinstance(value, float) and math.isnan(value)):
                raise HarnessError(
                    f"--{name.replace('_', '-')} must be greater than zero, got {value!r}."
                )

        for name in ("num_requests", "concurrency", "input_len", "output_len"):
            positive(name, getattr(self, name), integer=True)
        for name in ("duration_s", "request_rate", "burstiness", "timeout_s", "client_bound_ms",
                     "slice_duration_s"):  # fmt: skip
            positive(name, getattr(self, name))
        if self.max_error_rate is not None and not 0 <= self.max_error_rate < 1:
            raise HarnessError(
                f"--max-error-rate must be at least 0 and below 1, got {self.max_error_rate!r}."
            )
        positive("max_consecutive_errors", self.max_consecutive_errors, integer=True)
        if self.session_header is not None and not re.fullmatch(
            r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", self.session_header
        ):
            raise HarnessError(
                f"--session-header must be an HTTP header name (letters, digits, -), got {self.session_header!r}."
            )
        if self.settle_s < 0:
            raise HarnessError(f"settle_s must be zero or more, got {self.settle_s!r}.")
        if self.warmup < 0:
            raise HarnessError(f"--warmup must be zero or more, got {self.warmup!r}.")
        if self.endpoint is not None:
            if self.endpoint not in set(Endpoint):
                names = ", ".join(e.value for e in Endpoint)
                raise HarnessError(f"--endpoint must be one of {names}, got {self.endpoint!r}.")
            object.__setattr__(self, "endpoint", Endpoint(self.endpoint))
        if self.url is not None:
            object.__setattr__(self, "url", normalise_base_url(self.url))
        if self.extra_body is not None:
            check_extra_body(self.extra_body)
        from harness.engines import parse_assignments, parse_target

        parse_target(self.target)
        parse_assignments(self.engine_commands, "--engine-command")
        parse_assignments(self.engine_pythons, "--engine-python")
        if self.diverge_before < 0:
            raise HarnessError(
                f"--diverge-before must be zero or more, got {self.diverge_before!r}."
            )
        if self.workers is not None:
            object.__setattr__(self, "workers", parse_workers(self.workers))
        if self.faults is not None and (self.workers not in (None, 1) or self.ray_address):
            raise HarnessError(
                "--faults and --workers/--ray cannot be combined yet: a fault plan wraps one "
                "process's transport, so run fault plans with a single worker."
            )
        if self.on_worker_failure not in WORKER_FAILURE_POLICIES:
            raise HarnessError(
                f"--on-worker-failure must be one of {', '.join(WORKER_FAILURE_POLICIES)}, "
                f"got {self.on_worker_failure!r}."
            )
        if self.burstiness is not None and self.request_rate in (None, math.inf):
            raise HarnessError("--burstiness needs a finite --request-rate to shape.")

    @property
    def is_closed_loop(self) -> bool:
        return self.request_rate is None and self.concurrency is not None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out) if self.out else None
        d["request_rate"] = "inf" if self.request_rate == math.inf else self.request_rate
        d["server_args"] = list(self.server_args)
        d["engine_commands"] = list(self.engine_commands)
        d["engine_pythons"] = list(self.engine_pythons)
        d.pop("api_key")
        # Header values often carry credentials: record the names only.
        d["headers"] = [name for name, _ in self.headers]
        return d
