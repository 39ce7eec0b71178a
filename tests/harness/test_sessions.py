"""Multi-turn sessions in `run_load`, driven in-process through `FakeTransport`: each turn
carries the history with the engine's actual answers, waits for the previous turn plus its
think time, and a failed turn leaves the session's later turns `not_sent`, named."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from fake_transport import DONE_EVENT, FakeTransport, HttpError, Stream, sse_event, stream

from harness.http.client import ClientOptions, RawResult, RequestPayload
from harness.load.loadgen import LoadPlan, run_load
from harness.load.sessions import SessionPlan, sessions_from_rows
from slo.runrecord import Endpoint, RequestStatus


def _rows(n_sessions: int, turns: int, *, think_s: float = 0.0) -> list[dict]:
    rows = []
    for s in range(n_sessions):
        for t in range(turns):
            rows.append(
                {
                    "request_id": f"s{s}t{t}",
                    "session_id": f"sess-{s}",
                    "turn_index": t,
                    "arrival_s": 0.001 * s if t == 0 else None,
                    "think_s": think_s if t else None,
                    "prompt": f"user {s}.{t}",
                    "prompt_token_ids": [100 * s + 10 * t, 100 * s + 10 * t + 1],
                    "max_output_tokens": 4,
                    "ignore_eos": True,
                }
            )
    return rows


def _plan(rows, *, chat: bool, header: str | None = None, encode=None) -> LoadPlan:
    options = ClientOptions(
        base_url="http://x/v1", model="m", endpoint=Endpoint.CHAT if chat else Endpoint.COMPLETIONS
    )
    sessions = SessionPlan(sessions_from_rows(rows, options), chat, header, encode)
    payloads = [RequestPayload(r["request_id"], b"") for r in rows]
    return LoadPlan(payloads, [r["arrival_s"] for r in rows], sessions=sessions)


def _answer(payload: RequestPayload, *, chat: bool, with_ids: bool = True):
    """A two-event answer naming the request, with token ids 9000+ when `with_ids`."""
    n = int(payload.request_id[-1])
    kind = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for k, piece in enumerate((f" a{payload.request_id}", "!")):
        choice = {"index": 0, "finish_reason": "length" if k else None}
        choice.update({"delta": {"content": piece}} if chat else {"text": piece})
        if with_ids:
            choice["token_ids"] = [9000 + 10 * n + k]
        events.append(sse_event({"id": "x", "object": kind, "choices": [choice]}))
    return Stream([(0.0, e) for e in [*events, DONE_EVENT]])


async def _run(transport, plan) -> list[RawResult]:
    results: list[RawResult] = []
    await run_load(transport, plan, results.append)
    return results


def _bodies(transport) -> dict[str, dict]:
    return {s.request_id: orjson.loads(s.body) for s in transport.sent}


def test_chat_turns_carry_the_history_with_the_actual_answers():
    rows = _rows(2, 3, think_s=0.002)
    transport = FakeTransport(lambda p: _answer(p, chat=True))
    results = asyncio.run(_run(transport, _plan(rows, chat=True, header="x-session-id")))
    assert sorted(r.request_id for r in results) == sorted(r["request_id"] for r in rows)
    assert all(r.status is None for r in results)
    body = _bodies(transport)["s1t2"]
    assert body["messages"] == [
        {"role": "user", "content": "user 1.0"},
        {"role": "assistant", "content": " as1t0!"},
        {"role": "user", "content": "user 1.1"},
        {"role": "assistant", "content": " as1t1!"},
        {"role": "user", "content": "user 1.2"},
    ]
    assert "return_token_ids" not in body
    by_id = {r.request_id: r for r in results}
    for s in range(2):
        for t in (1, 2):
            prev, turn = by_id[f"s{s}t{t - 1}"], by_id[f"s{s}t{t}"]
            # due when the previous turn ended plus the think time, sent no earlier
            assert turn.t_scheduled_ns == prev.t_done_ns + 2_000_000
            assert turn.t_sent_ns >= turn.t_scheduled_ns


def test_session_header_on_every_turn():
    seen: list[tuple[str, dict | None]] = []

    def script(payload):
        seen.append((payload.request_id, payload.headers))
        return _answer(payload, chat=True)

    asyncio.run(_run(FakeTransport(script), _plan(_rows(2, 2), chat=True, header="x-session-id")))
    assert sorted(seen) == [
        ("s0t0", {"x-session-id": "sess-0"}),
        ("s0t1", {"x-session-id": "sess-0"}),
        ("s1t0", {"x-session-id": "sess-1"}),
        ("s1t1", {"x-session-id": "sess-1"}),
    ]


@pytest.mark.parametrize("with_ids", [True, False])
def test_completions_prompt_is_the_previous_prompt_answer_and_message_in_token_ids(with_ids):
    encoded: list[str] = []

    def encode(text: str) -> list[int]:
        encoded.append(text)
        return [7000 + len(text)]

    transport = FakeTransport(lambda p: _answer(p, chat=False, with_ids=with_ids))
    asyncio.run(_run(transport, _plan(_rows(1, 3), chat=False, encode=encode)))
    bodies = _bodies(transport)
    answer0 = [9000, 9001] if with_ids else [7000 + len(" as0t0!")]
    answer1 = [9010, 9011] if with_ids else [7000 + len(" as0t1!")]
    assert bodies["s0t0"]["prompt"] == [0, 1]
    assert bodies["s0t1"]["prompt"] == [0, 1, *answer0, 10, 11]
    assert bodies["s0t2"]["prompt"] == [0, 1, *answer0, 10, 11, *answer1, 20, 21]
    assert all(b["return_token_ids"] is True for b in bodies.values())
    assert encoded == ([] if with_ids else [" as0t0!", " as0t1!"])


def test_a_failed_turn_leaves_the_rest_of_its_session_not_sent():
    def script(payload):
        if payload.request_id == "s0t1":
            return HttpError(500, "boom")
        return _answer(payload, chat=True)

    transport = FakeTransport(script)
    results = asyncio.run(_run(transport, _plan(_rows(2, 4), chat=True)))
    by_id = {r.request_id: r for r in results}
    assert len(results) == 8 == len(by_id)  # one result per turn
    assert {s.request_id for s in transport.sent} == {
        "s0t0",
        "s0t1",
        "s1t0",
        "s1t1",
        "s1t2",
        "s1t3",
    }
    for rid in ("s0t2", "s0t3"):
        assert by_id[rid].status is RequestStatus.NOT_SENT
        assert "turn 1 of session sess-0 (s0t1) ended with error" in by_id[rid].error_message
    assert by_id["s0t1"].status is RequestStatus.ERROR
    assert all(by_id[f"s1t{t}"].status is None for t in range(4))


def test_cancelling_mid_session_accounts_for_every_turn():
    def script(payload):
        if payload.request_id.endswith("t1"):
            return stream(["x"], first_byte_s=30.0)  # hangs until cancelled
        return _answer(payload, chat=True)

    async def go():
        transport = FakeTransport(script)
        results: list[RawResult] = []
        task = asyncio.create_task(
            run_load(transport, _plan(_rows(2, 3), chat=True), results.append)
        )
        async with asyncio.timeout(10):
            await transport.wait_for_in_flight(2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return results

    results = asyncio.run(go())
    status = {r.request_id: r.status for r in results}
    assert len(results) == 6 == len(status)
    assert status["s0t1"] is RequestStatus.CANCELLED and status["s1t1"] is RequestStatus.CANCELLED
    assert status["s0t2"] is RequestStatus.NOT_SENT and status["s1t2"] is RequestStatus.NOT_SENT


def test_closed_loop_users_run_whole_sessions():
    rows = [dict(r, arrival_s=None) for r in _rows(3, 2)]
    options = ClientOptions(base_url="http://x/v1", model="m", endpoint=Endpoint.CHAT)
    sessions = SessionPlan(sessions_from_rows(rows, options), True)
    plan = LoadPlan(
        [RequestPayload(r["request_id"], b"") for r in rows], None, 1, sessions=sessions
    )
    transport = FakeTransport(lambda p: _answer(p, chat=True))
    asyncio.run(_run(transport, plan))
    assert [s.request_id for s in transport.sent] == [
        "s0t0",
        "s0t1",
        "s1t0",
        "s1t1",
        "s2t0",
        "s2t1",
    ]
    assert transport.max_in_flight == 1
