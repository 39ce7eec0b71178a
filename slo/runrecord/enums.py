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
    """The API a run drives, with its path under the base URL (`.../v1`).

    Completions and chat are OpenAI's; `responses` is OpenAI's Responses API and `messages`
    Anthropic's Messages API (both stream typed events); `embeddings` and `rerank` answer whole
    (never streamed): their latency is the request's, their tokens are the inputs'."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"
    EMBEDDINGS = "embeddings"
    RERANK = "rerank"

    @property
    def path(self) -> str:
        return _ENDPOINT_PATHS[self]

    @property
    def generates(self) -> bool:
        """True for the endpoints that generate text (and so stream tokens); False for
        embeddings and rerank."""
        return self not in (Endpoint.EMBEDDINGS, Endpoint.RERANK)


_ENDPOINT_PATHS = {
    Endpoint.COMPLETIONS: "/completions",
    Endpoint.CHAT: "/chat/completions",
    Endpoint.RESPONSES: "/responses",
    Endpoint.MESSAGES: "/messages",
    Endpoint.EMBEDDINGS: "/embeddings",
    Endpoint.RERANK: "/rerank",
}


class OutputFlag(StrEnum):
    """What an output check found wrong with an ok request (MLPerf TEST06 in spirit); a request's
    flags are stored comma-separated in `output_flags`."""

    DIVERGED = "diverged"  # differs from the reference output before the allowed position
    SHORT_IGNORE_EOS = "short_ignore_eos"  # ignore_eos asked, fewer tokens than max_tokens came
    FIRST_TOKEN_DIFFERS = "first_token_differs"  # the first token differs from the reference's
    USAGE_MISMATCH = "usage_mismatch"  # usage.completion_tokens disagrees with the tokens streamed
    CONSTRAINT_VIOLATED = "constraint_violated"  # breaks the workload's schema, regex or choice
    TOOL_CALL_INVALID = "tool_call_invalid"  # a bad call: JSON, function, schema, none or other
