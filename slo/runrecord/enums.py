"""The closed vocabularies of a run record: request status, error class, output-token source and
endpoint. Every other module uses these members; none spells their strings."""

from __future__ import annotations

from enum import StrEnum


class RequestStatus(StrEnum):
    """The one terminal outcome of a request, as `requests.parquet` stores it."""

    OK = "ok"
    ERROR = "error"  # with an ErrorClass saying which
    TIMEOUT = "timeout"  # no complete response within the per-request timeout
    CANCELLED = "cancelled"  # the run stopped while the request was in flight
    REJECTED = "rejected"  # the server refused it explicitly (429)
    UNKNOWN = "unknown"  # sent, then the connection broke before a terminal event: the server
    # may or may not have done the work
    NOT_SENT = "not_sent"  # scheduled, never dispatched: the run stopped first

    @property
    def attempted(self) -> bool:
        """False only for `not_sent`: the request never reached the target."""
        return self is not RequestStatus.NOT_SENT


class ErrorClass(StrEnum):
    """Why a request did not finish `ok`; null for `ok` and `cancelled` requests."""

    CONNECTION_REFUSED = "connection_refused"
    CONNECTION_ERROR = "connection_error"  # other connect failures
    CONNECTION_RESET = "connection_reset"
    REJECTED_429 = "rejected_429"
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    TIMEOUT = "timeout"
    INCOMPLETE_STREAM = "incomplete_stream"  # the stream ended without [DONE]
    MALFORMED_SSE = "malformed_sse"
    MALFORMED_JSON = "malformed_json"
    STREAM_ERROR = "stream_error"  # an {"error": ...} event inside a 200 stream
    CLIENT_ERROR = "client_error"
    WORKER_LOST = "worker_lost"  # the worker process (or Ray actor) sending it died mid-request


class TokenSource(StrEnum):
    """Where a request's `output_tokens` figure, or its chunks' token counts, came from."""

    USAGE = "usage"  # the server's `usage.completion_tokens` (per chunk: the usage so far)
    TOKEN_IDS = "token_ids"  # the token ids each chunk carries (vLLM's `return_token_ids`)
    TOKENIZER = "tokenizer"  # the output text retokenised with the run's tokenizer
    CHUNK_COUNT = "chunk_count"  # the number of token-bearing chunks

    @property
    def counted_by_client(self) -> bool:
        """True when the client, not the server, counted the tokens."""
        return self is not TokenSource.USAGE


class Endpoint(StrEnum):
    """The OpenAI-compatible API a run drives, with its path under the base URL."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/chat/completions" if self is Endpoint.CHAT else "/completions"


class OutputFlag(StrEnum):
    """What an output check found wrong with an ok request (MLPerf TEST06 in spirit); a request's
    flags are stored comma-separated in `output_flags`."""

    DIVERGED = "diverged"  # differs from the reference output before the allowed position
    SHORT_IGNORE_EOS = "short_ignore_eos"  # ignore_eos asked, fewer tokens than max_tokens came
    FIRST_TOKEN_DIFFERS = "first_token_differs"  # the first token differs from the reference's
    USAGE_MISMATCH = "usage_mismatch"  # usage.completion_tokens disagrees with the tokens streamed
    CONSTRAINT_VIOLATED = "constraint_violated"  # breaks the workload's schema, regex or choice
