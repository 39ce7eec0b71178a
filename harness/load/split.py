"""One hash-pinned schedule split into worker shares (`--workers`, `--ray`).

Request i of the schedule goes to worker i mod N (open loop: the arrival process is thinned
evenly and every request keeps its own arrival offset; closed loop: user u is on worker u mod N
and request i goes to the worker of user i mod users; sessions: whole sessions). The shares run
in worker processes (`harness.load.pool`) or Ray actors (`harness.load.ray_workers`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import orjson

from harness.errors import HarnessError
from harness.http.client import ClientOptions
from harness.load.loadgen import LoadPlan

# `--workers auto`: expected output tokens/s one worker keeps up with (one process ingests
# 680-750k from the cheap mock with the compiled stream scanner: benchmarks/client_capacity.py)
TOKENS_PER_S_PER_WORKER = 600_000
USERS_PER_WORKER = 64  # `--workers auto`, closed loop
MAX_CONNECTIONS = 4096  # the most connections one transport's pool opens
SAME_HOST_CLOCK = (
    "CLOCK_MONOTONIC (time.perf_counter_ns), shared by every process of one host: the "
    "workers' times need no alignment"
)


@dataclass(frozen=True)
class WorkerShare:
    """One worker's part of the plan (`index` of `count`), with how to reach the target."""

    index: int
    count: int
    options: ClientOptions
    plan: LoadPlan
    max_connections: int

    @property
    def request_ids(self) -> list[str]:
        """Every request this worker was given (warm-up first), in schedule order."""
        return [*(p.request_id for p in self.plan.warmup), *self.plan.request_ids()]

    def scheduled_ns(self, t0_ns: int | None) -> dict[str, int | None]:
        """Each request's scheduled time once the run started at `t0_ns` (None: closed loop,
        a later turn, warm-up, or not started)."""
        arrivals = self.plan.arrival_s or [None] * len(self.plan.payloads)
        out: dict[str, int | None] = {p.request_id: None for p in self.plan.warmup}
        for request_id, offset_s in zip(self.plan.request_ids(), arrivals, strict=True):
            out[request_id] = (
                None if t0_ns is None or offset_s is None else t0_ns + round(offset_s * 1e9)
            )
        return out


def _split_evenly(total: int, n: int) -> list[int]:
    """`total` split into `n` whole parts that differ by at most one, larger parts first."""
    return [total // n + (1 if k < total % n else 0) for k in range(n)]


def split_plan(plan: LoadPlan, workers: int) -> list[LoadPlan]:
    """`plan` split into at most `workers` plans whose union is `plan` (each request once).

    Fewer plans come back when there are fewer units to split (requests, sessions, closed-loop
    users, or slots of an open-loop concurrency cap), so no worker is idle.
    """
    closed = plan.arrival_s is None
    units = len(plan.sessions.sessions) if plan.sessions is not None else len(plan.payloads)
    n = max(1, min(workers, units))
    if plan.concurrency:
        n = min(n, plan.concurrency)
    caps = _split_evenly(plan.concurrency, n) if plan.concurrency else [None] * n
    if plan.sessions is not None:
        owner_of_session = {s.session_id: k % n for k, s in enumerate(plan.sessions.sessions)}
        owner = {
            turn.request_id: owner_of_session[s.session_id]
            for s in plan.sessions.sessions
            for turn in s.turns
        }
    elif closed:
        owner = {rid: (i % plan.concurrency) % n for i, rid in enumerate(plan.request_ids())}
    else:
        owner = {rid: i % n for i, rid in enumerate(plan.request_ids())}
    arrivals = plan.arrival_s if plan.arrival_s is not None else [None] * len(plan.payloads)
    shares: list[list] = [[] for _ in range(n)]
    for p, a in zip(plan.payloads, arrivals, strict=True):  # one pass: a streamed plan's bodies
        shares[owner[p.request_id]].append((p, a))  # are built once
    plans = []
    for k, mine in enumerate(shares):
        sessions = None
        if plan.sessions is not None:
            sessions = replace(
                plan.sessions,
                sessions=tuple(s for j, s in enumerate(plan.sessions.sessions) if j % n == k),
            )
        plans.append(
            LoadPlan(
                payloads=[p for p, _ in mine],
                arrival_s=None if plan.arrival_s is None else [a for _, a in mine],
                concurrency=caps[k],
                duration_s=plan.duration_s,
                warmup=[w for j, w in enumerate(plan.warmup) if j % n == k],
                sessions=sessions,
            )
        )
    return plans


def auto_workers(plan: LoadPlan, cores: int | None = None) -> tuple[int, str]:
    """(`--workers auto`'s count, why): one worker per `TOKENS_PER_S_PER_WORKER` expected
    output tokens/s (open loop: the schedule's mean rate x mean max_tokens) or per
    `USERS_PER_WORKER` closed-loop users, at most cores - 1, at least 1."""
    cores = cores or os.cpu_count() or 1
    ceiling = max(1, cores - 1)
    if plan.arrival_s is None:
        users = plan.concurrency or 1
        wanted = -(-users // USERS_PER_WORKER)
        basis = f"{users} closed-loop users at {USERS_PER_WORKER} per worker"
    else:
        span_s = max(plan.arrival_s) if plan.arrival_s else 0.0
        rate = len(plan.arrival_s) / span_s if span_s > 0 else float("inf")
        lengths = [orjson.loads(p.body).get("max_tokens") or 0 for p in plan.payloads[:1000]]
        mean_len = sum(lengths) / len(lengths) if lengths else 0
        tokens_per_s = rate * mean_len
        wanted = (
            ceiling
            if tokens_per_s == float("inf")
            else max(1, -(-int(tokens_per_s) // TOKENS_PER_S_PER_WORKER))
        )
        basis = (
            f"expected {tokens_per_s:.0f} output tokens/s ({rate:.3g} requests/s x "
            f"{mean_len:.0f} tokens) at {TOKENS_PER_S_PER_WORKER} per worker"
        )
    count = max(1, min(wanted, ceiling))
    return count, f"{basis}, at most {ceiling} (cores - 1 of {cores}): {count}"


@dataclass(frozen=True)
class WorkerSplit:
    """How a run's plan was split: the shares, and what the manifest says about them."""

    shares: list[WorkerShare]
    mode: str  # "processes" or "ray"
    requested: int | str | None  # what --workers said
    why: str  # how the count was chosen
    clock: str  # how the workers' times are put on one timeline

    def worker_of(self) -> dict[str, int]:
        """request id -> the worker that was given it."""
        return {rid: s.index for s in self.shares for rid in s.request_ids}

    def manifest_entry(self) -> dict:
        return {
            "mode": self.mode,
            "count": len(self.shares),
            "requested": self.requested,
            "why": self.why,
            "assignment": ASSIGNMENT,
            "clock": self.clock,
        }


ASSIGNMENT = (
    "open loop: request i of the schedule on worker i mod N, each at its own arrival offset; "
    "closed loop: user u on worker u mod N, request i on the worker of user i mod users; "
    "sessions: whole sessions, session j on worker j mod N; warm-up request j on worker j mod N"
)


def split_for(plan: LoadPlan, options: ClientOptions, *, workers: int | str) -> WorkerSplit:
    """The `WorkerSplit` of `--workers` (a count or `auto`) into local worker processes."""
    if workers == "auto":
        wanted, why = auto_workers(plan)
    else:
        wanted, why = int(workers), f"--workers {workers}"
    return split_into(
        plan, options, wanted, requested=workers, why=why, mode="processes", clock=SAME_HOST_CLOCK
    )


def split_into(
    plan: LoadPlan,
    options: ClientOptions,
    wanted: int,
    *,
    requested: int | str | None,
    why: str,
    mode: str,
    clock: str,
) -> WorkerSplit:
    """`plan` split into `wanted` shares (fewer when there is less to split; `why` then says
    so), recorded with what `--workers` said, how the count was chosen, the mode (`processes`
    or `ray`) and how the workers' clocks are aligned."""
    plans = split_plan(plan, wanted)
    if len(plans) < wanted:
        why += f"; {len(plans)} used (no more requests, sessions, users or slots to split)"
    shares = [
        WorkerShare(k, len(plans), options, part, connection_pool_size(part))
        for k, part in enumerate(plans)
    ]
    return WorkerSplit(shares, mode, requested, why, clock)


def connection_pool_size(plan: LoadPlan) -> int:
    """Connections one transport opens for `plan`: its concurrency, else one per request
    (warm-up's when more), at most MAX_CONNECTIONS."""
    return min(plan.concurrency or max(len(plan.payloads), len(plan.warmup), 1), MAX_CONNECTIONS)


def check_workers_supported(transport) -> None:
    """Refuse, in one sentence, what `--workers`/`--ray` cannot do: a test transport lives in
    this process only (`--faults` with workers is refused by `RunConfig`)."""
    if transport is not None:
        raise HarnessError("a test transport runs in this process only; drop --workers/--ray.")
