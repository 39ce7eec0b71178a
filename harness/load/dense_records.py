"""The `requests.parquet` row of an embeddings or rerank request (`harness.http.dense`).

Such a request answers whole, so its record has a latency (`t_sent_ns` -> `t_done_ns`) and no
token times: `t_first_token_ns` and `t_last_token_ns` stay null, which leaves TTFT, TPOT and
ITL undefined (null), never zero. It generates nothing (`output_tokens` 0, no chunks); its
tokens are its inputs': `input_tokens` as the plan counted them (the batch's texts by the run's
tokenizer) and `usage_prompt_tokens` as the server reported. `num_texts` is the number of
texts sent, and the answer must hold one vector (or score) per text, else the request is an
error (`malformed_json`, see `harness.http.dense.check_answer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.http.client import RawResult
from harness.http.dense import check_answer
from slo.runrecord import RequestRecord, RequestStatus

if TYPE_CHECKING:  # records.py imports this module
    from harness.load.records import RecordContext


def _rel(t_ns: int | None, t0_ns: int) -> int | None:
    return None if t_ns is None else t_ns - t0_ns


def dense_record(
    raw: RawResult,
    input_tokens: int | None,
    ctx: RecordContext,
    t_slot_freed_ns: int | None,
    session: tuple[str, int] | None = None,
    request_class: tuple[int | None, int | None, str | None] | None = None,
) -> RequestRecord:
    """The row of one dense request; `t_slot_freed_ns` is already relative to t0."""
    batch_size = (ctx.batch_sizes or {}).get(raw.request_id)
    status, error_class, message = raw.status, raw.error_class, raw.error_message
    usage: dict = {}
    response_id = None
    if status is None:  # a 200 answer: check its shape
        answer = check_answer(raw.body or b"", ctx.endpoint, batch_size)
        usage, response_id = answer.usage or {}, answer.response_id
        if answer.error_message is None:
            status = RequestStatus.OK
        else:
            status, error_class, message = (
                RequestStatus.ERROR,
                answer.error_class,
                answer.error_message,
            )
    prompt_tokens = usage.get("prompt_tokens")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
        prompt_tokens = None
    t0 = ctx.t0_ns
    record = RequestRecord(
        request_id=raw.request_id,
        t_scheduled_ns=_rel(raw.t_scheduled_ns, t0),
        t_sent_ns=_rel(raw.t_sent_ns, t0),
        t_first_byte_ns=_rel(raw.t_first_byte_ns, t0),
        t_done_ns=_rel(raw.t_done_ns, t0),
        status=status,
        http_status=raw.http_status,
        error_class=error_class,
        error_message=message,
        input_tokens=input_tokens,
        usage_prompt_tokens=prompt_tokens,
        output_tokens=0 if status is RequestStatus.OK else None,
        output_chars=0,
        num_chunks=0,
        is_warmup=raw.is_warmup,
        response_id=response_id,
        engine_request_id=raw.engine_request_id,
        session_id=session[0] if session else None,
        turn_index=session[1] if session else None,
        t_slot_freed_ns=t_slot_freed_ns,
        num_texts=batch_size,
    )
    if request_class is not None:
        record.priority, record.deadline_ms, record.tenant = request_class
    return record
