"""`ServerConfig`: how the reference server serves, validated once (by `bench serve` or a test)
and passed down. Its defaults are the server's defaults; the CLI sets only what it is given."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from engine_ref.serving.engine_loop import ENGINE_LOOP_MODES
from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.reasoning import REASONING_PARSERS

MIB = 1 << 20


class ServerError(Exception):
    """The server cannot start as configured; the message is one sentence naming the fix."""


@dataclass(frozen=True)
class ServerConfig:
    """How to serve: the engine's own config plus the HTTP side. `port` 0 picks a free port.

    Answers: `retry_after_s` is the Retry-After header (seconds) of 429 answers; `api_key` set
    means every /v1/* route needs `Authorization: Bearer <api_key>` (/health, /metrics and
    /info stay open, as in vLLM); `enable_prompt_tokens_details` adds
    `usage.prompt_tokens_details.cached_tokens` (vLLM's flag of that name);
    `enable_fault_injection` adds `POST /admin/step_delay` (body `{"delay_ms": N}`), which makes
    every engine step N ms slower until set back to 0: `bench run --faults` uses it for its
    `slow_steps` windows. Off by default, so a production server exposes no such route.

    Limits (each answered in one sentence naming its flag):
    - `max_body_bytes` (16 MiB): a larger body is refused with 413, from its Content-Length
      before it is read, or once reading passes the bound.
    - `max_prompt_chars` (1,000,000): a request whose prompt text (all its prompts, or all
      its messages) is longer is refused with 400 before it is tokenized (the tokenizer runs at
      about 1 M characters/s and takes about 200 bytes per character meanwhile). Prompts must
      also leave room for one output token within the engine's `max_model_len` (400).
    - `header_timeout_s` (10 s): a connection must deliver a complete request head this soon
      after it opens, or after the first byte of a later request; otherwise it is closed.
    - `stream_write_timeout_s` (30 s) and `max_stream_backlog` (256 outputs per engine
      request): a stream whose client stopped reading is abandoned once one write has waited
      that long or that many engine outputs wait behind it; the request is aborted in the
      engine (freeing its KV blocks, counted as an abort) and the connection closed.

    `reasoning_parser` "think" splits chat outputs' `<think>` spans into `reasoning_content`
    (`engine_ref.serving.reasoning`); None (the default) leaves every answer as it is.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    engine_loop: str = "thread"
    served_model_name: str | None = None
    retry_after_s: int = 1
    api_key: str | None = None
    enable_prompt_tokens_details: bool = False
    enable_fault_injection: bool = False
    max_body_bytes: int = 16 * MIB
    max_prompt_chars: int = 1_000_000
    header_timeout_s: float = 10.0
    stream_write_timeout_s: float = 30.0
    max_stream_backlog: int = 256
    reasoning_parser: str | None = None  # "think": `engine_ref.serving.reasoning`

    def __post_init__(self) -> None:
        if self.engine_loop not in ENGINE_LOOP_MODES:
            raise ServerError(
                f"Unknown engine loop {self.engine_loop!r}; use one of {', '.join(ENGINE_LOOP_MODES)}."
            )
        if not 0 <= self.port <= 65535:
            raise ServerError(f"Port {self.port} is outside 0..65535.")
        if self.retry_after_s < 0:
            raise ServerError("retry_after_s must be non-negative.")
        if self.api_key is not None and not self.api_key:
            raise ServerError("The API key must not be empty; leave --api-key out for none.")
        for name in ("max_body_bytes", "max_prompt_chars", "max_stream_backlog"):
            if getattr(self, name) < 1:
                raise ServerError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ServerError(
                f"Unknown reasoning parser {self.reasoning_parser!r}; use "
                f"{', '.join(REASONING_PARSERS)} or leave --reasoning-parser out."
            )
        for name in ("header_timeout_s", "stream_write_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ServerError(f"{name} must be a positive number of seconds, got {value}.")
