"""Multi-turn sessions in the load generator: turn k+1 of a conversation is sent only after
turn k's answer arrived plus the turn's think time, carrying the whole history.

The history is the session's earlier user messages and the engine's actual answers. Chat sends
it as a messages list (the answers as assistant messages, as a chat client does); completions
sends one token-id prompt, the earlier prompt's ids followed by the answer's ids and the new
message's ids, so turn k+1's prompt starts with turn k's prompt and answer token for token. The
answer's ids are the ones the server streamed back when it honours `return_token_ids` (vLLM's
extension, which the reference engine has), else the answer text encoded with the run's
tokenizer. A chat history is exact only as far as the answer text re-encodes to the tokens the
engine generated (natural text mostly does; random tokens often do not).

A turn that does not end `ok` ends its session: the remaining turns are recorded `not_sent`,
with the failed turn named in their error message (AIPerf and vLLM's multi-turn benchmark
drop the rest of a conversation too), so the ledger still holds one row per turn. Turns whose
time comes after the run's duration are `not_sent` as well; sessions that would start after
it are outside the run, as open-loop requests past the duration are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field

import orjson

from harness.http.client import (
    ClientOptions,
    RawResult,
    RequestPayload,
    body_fields,
    request_headers,
)
from harness.http.sse import DONE, parse_body, parse_stream, split_events
from slo.runrecord import RequestStatus


@dataclass(frozen=True)
class Turn:
    """One turn as the workload gave it: its row's body fields and its new user message."""

    request_id: str
    fields: dict
    user_text: str
    user_ids: tuple[int, ...] | None
    think_s: float


@dataclass(frozen=True)
class Session:
    """A conversation: `arrival_s` is its first turn's offset (None: closed loop)."""

    session_id: str
    arrival_s: float | None
    turns: tuple[Turn, ...]
    headers: tuple[tuple[str, str], ...] = ()  # every turn's own (its deadline)


@dataclass(frozen=True)
class SessionPlan:
    """The sessions of a run and how to send them. `session_header` names an HTTP header that
    carries the session id on every turn (session affinity for a router); `encode` counts
    answer tokens for completions when the server sends no token ids."""

    sessions: tuple[Session, ...]
    chat: bool
    session_header: str | None = None
    encode: Callable[[str], list[int]] | None = None


def sessions_from_rows(rows: Sequence[dict], options: ClientOptions) -> tuple[Session, ...]:
    """Group RequestSpec rows (dicts, in table order) by `session_id`, turns by `turn_index`."""
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["session_id"], []).append(row)
    sessions = []
    for sid, turns in grouped.items():
        turns.sort(key=lambda r: r["turn_index"])
        sessions.append(
            Session(
                session_id=sid,
                arrival_s=turns[0]["arrival_s"],
                headers=tuple((request_headers(turns[0]) or {}).items()),
                turns=tuple(
                    Turn(
                        request_id=r["request_id"],
                        fields=body_fields(options, r),
                        user_text=r["prompt"],
                        user_ids=tuple(r["prompt_token_ids"])
                        if r.get("prompt_token_ids")
                        else None,
                        think_s=float(r.get("think_s") or 0.0),
                    )
                    for r in turns
                ),
            )
        )
    return tuple(sessions)


@dataclass
class History:
    """What a session has said so far, as the next turn's body needs it."""

    plan: SessionPlan
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def body(self, turn: Turn) -> bytes:
        fields = dict(turn.fields)
        if self.plan.chat:
            fields["messages"] = [*self.messages, {"role": "user", "content": turn.user_text}]
        else:
            user = (
                list(turn.user_ids) if turn.user_ids is not None else self._encode(turn.user_text)
            )
            fields["prompt"] = [*self.token_ids, *user]
            fields["return_token_ids"] = True
        return orjson.dumps(fields)

    def add(self, turn: Turn, answer_text: str, answer_ids: list[int] | None) -> None:
        if self.plan.chat:
            self.messages += [
                {"role": "user", "content": turn.user_text},
                {"role": "assistant", "content": answer_text},
            ]
            return
        user = list(turn.user_ids) if turn.user_ids is not None else self._encode(turn.user_text)
        ids = answer_ids if answer_ids is not None else self._encode(answer_text)
        self.token_ids += [*user, *ids]

    def _encode(self, text: str) -> list[int]:
        if self.plan.encode is None:
            raise ValueError("completions sessions need a tokenizer for text without token ids")
        return list(self.plan.encode(text))


def answer_of(raw: RawResult, *, chat: bool) -> tuple[str | None, list[int] | None]:
    """The answer's text (None when the turn did not end ok) and its token ids when every
    text-bearing event carried `token_ids` (None otherwise)."""
    if raw.status is not None:
        return None, None
    if raw.body is not None:
        parsed = parse_body(raw.body, chat=chat)
        objects = [orjson.loads(raw.body)] if parsed.error_class is None else []
    else:
        parsed = parse_stream(raw.reads, chat=chat)
        events, _, _ = split_events(raw.reads)
        objects = (
            [orjson.loads(p) for _, p in events if p != DONE] if parsed.error_class is None else []
        )
    if parsed.error_class is not None:
        return None, None
    ids: list[int] = []
    for obj in objects:
        for choice in obj.get("choices") or []:
            piece = (
                (choice.get("delta") or choice.get("message") or {}).get("content")
                if chat
                else choice.get("text")
            )
            token_ids = choice.get("token_ids")
            if token_ids is None:
                if piece:
                    return parsed.text, None
                continue
            ids += token_ids
    return parsed.text, ids


Send = Callable[[RequestPayload, int, bool], Awaitable[RawResult]]


async def drive_sessions(
    plan: SessionPlan,
    *,
    t0: int,
    deadline_ns: int | None,
    limit: asyncio.Semaphore | None,
    users: int | None,
    send: Send,
    spawn: Callable[[Coroutine], None],
    dispatched: set[str],
    on_result: Callable[[RawResult], None],
) -> tuple[int, bool]:
    """Start every session (at its arrival, or `users` at a time back to back when closed
    loop) as a task through `spawn`; returns (sessions started, stopped by the duration).
    Each turn goes out through `send(payload, t_scheduled_ns, acquired)`."""
    clock = time.perf_counter_ns

    def not_sent(turns: Sequence[Turn], t_scheduled: int | None, reason: str) -> None:
        for turn in turns:
            dispatched.add(turn.request_id)
            raw = RawResult(turn.request_id, False, t_scheduled)
            raw.status = RequestStatus.NOT_SENT
            raw.error_message = reason
            on_result(raw)

    async def run_session(session: Session, t_scheduled: int) -> None:
        history = History(plan)
        headers = dict(session.headers)
        if plan.session_header:
            headers[plan.session_header] = session.session_id
        headers = headers or None
        for k, turn in enumerate(session.turns):
            if deadline_ns is not None and t_scheduled >= deadline_ns:
                not_sent(
                    session.turns[k:],
                    t_scheduled,
                    "the run's duration ended before this turn was due",
                )
                return
            delay = t_scheduled - clock()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            if limit is not None:
                await limit.acquire()
            payload = RequestPayload(turn.request_id, history.body(turn), headers=headers)
            raw = await send(payload, t_scheduled, limit is not None)
            text, ids = answer_of(raw, chat=plan.chat)
            if text is None:
                status = raw.status.value if raw.status is not None else "a malformed answer"
                not_sent(
                    session.turns[k + 1 :],
                    None,
                    f"turn {k} of session {session.session_id} ({turn.request_id}) ended with "
                    f"{status}, so the session's later turns were not sent",
                )
                return
            if k + 1 == len(session.turns):
                return
            history.add(turn, text, ids)
            t_scheduled = (raw.t_done_ns or clock()) + round(turn_think(session, k) * 1e9)

    if users is not None:  # closed loop: each user runs whole sessions back to back
        queue = iter(plan.sessions)

        async def user() -> None:
            for session in queue:
                if deadline_ns is not None and clock() >= deadline_ns:
                    return
                await run_session(session, clock())

        for _ in range(users):
            spawn(user())
        return len(plan.sessions), False
    started_n = 0
    for session in plan.sessions:
        t_first = t0 + round((session.arrival_s or 0.0) * 1e9)
        if deadline_ns is not None and t_first >= deadline_ns:
            return started_n, True
        delay = t_first - clock()
        if delay > 0:
            await asyncio.sleep(delay / 1e9)
        spawn(run_session(session, t_first))
        started_n += 1
    return started_n, False


def turn_think(session: Session, k: int) -> float:
    """Seconds between turn k's answer and turn k + 1 (0 after the last turn)."""
    return session.turns[k + 1].think_s if k + 1 < len(session.turns) else 0.0
