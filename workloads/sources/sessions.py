"""The sessions source: conversations of T turns, one RequestSpec row per turn.

A row holds the turn's new user message only (`prompt`, `prompt_token_ids`, `input_tokens`);
the harness sends it after the session's earlier turns and the engine's actual answers to them
(`harness.sessions`), so the prompt the server sees grows turn by turn. `session_id` names the
conversation, `turn_index` counts from 0, `arrival_s` is the session's arrival on its first turn
and null on the others, and `think_s` is the pause between the previous turn's answer and this
turn (null on first turns).

Sources: synthetic (`turns`, `input`, `output` and optional `think_ms` length distributions,
one `turns` draw per session and one `input`/`output`/`think_ms` draw per turn) or ShareGPT
conversations with all their turns (`path`; the recorded answers' token counts are the output
lengths unless `output` is given; `max_turns` caps a conversation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.assemble import plain_prompts
from workloads.loaders import load_sharegpt_conversations
from workloads.prompts import Prompt, encode_many
from workloads.schedule import Schedule
from workloads.schema import WorkloadError
from workloads.sources.base import (
    NOWHERE,
    BuildContext,
    Rows,
    at,
    check_length,
    read_source,
)

SYNTHETIC_KEYS = ("turns", "input", "output")


@dataclass(frozen=True)
class SessionColumns:
    """Per row: session id, turn index, think time (NaN on first turns); per session: its
    first row."""

    session_id: list[str]
    turn_index: np.ndarray
    think_s: np.ndarray
    first_row: np.ndarray

    def row_times(self, session_times: np.ndarray | None) -> np.ndarray | None:
        """Arrival offsets per row: the session's on its first turn, NaN (null) on the rest."""
        if session_times is None:
            return None
        out = np.full(len(self.session_id), np.nan)
        out[self.first_row] = session_times
        return out


def _columns(turns: np.ndarray, think_ms: np.ndarray) -> SessionColumns:
    width = max(4, len(str(len(turns) - 1)))
    first = np.concatenate([[0], np.cumsum(turns)[:-1]]).astype(np.int64)
    turn_index = np.concatenate([np.arange(t) for t in turns]).astype(np.int32)
    think = think_ms / 1000.0
    think[turn_index == 0] = np.nan
    ids = [f"sess-{s:0{width}d}" for s, t in enumerate(turns.tolist()) for _ in range(t)]
    return SessionColumns(ids, turn_index, think, first)


@dataclass(frozen=True)
class SessionsSource:
    """`{kind: sessions, turns, input, output, think_ms}` (synthetic) or `{kind: sessions,
    path, max_turns, shuffle, output}` (ShareGPT conversations); lengths as in
    `workloads.lengths`, `think_ms` 0 for no pause. num_requests counts sessions."""

    kind: ClassVar[str] = "sessions"
    reads_dataset: ClassVar[bool] = True
    default_num_requests: ClassVar[int | None] = 100

    path: str | None = None
    turns: Any = None
    input: Any = None
    output: Any = None
    think_ms: Any = 0
    max_turns: int | None = None
    shuffle: bool = True
    where: Where = field(default=NOWHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.path is None:
            for key in SYNTHETIC_KEYS:
                if getattr(self, key) is None:
                    at("").fail(
                        f"missing key {key!r}",
                        "synthetic sessions need turns, input and output (ShareGPT ones: path)",
                    )
        elif self.turns is not None or self.input is not None:
            at("").fail(
                "path and turns/input are both given",
                "expected either path (ShareGPT conversations) or turns and input",
            )
        else:
            ys.string(self.path, at("path"), what="a ShareGPT JSON file")
        for key in SYNTHETIC_KEYS:
            if getattr(self, key) is not None:
                check_length(getattr(self, key), at(key))
        check_length(self.think_ms, at("think_ms"), zero=True)
        if self.max_turns is not None:
            ys.number(self.max_turns, at("max_turns"), minimum=1, integer=True)
        ys.boolean(self.shuffle, at("shuffle"))

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> SessionsSource:
        names = ("turns", "input", "output", "think_ms", "path", "max_turns", "shuffle")
        return read_source(cls, data, at(where), names)

    @property
    def takes_prefix(self) -> bool:
        return False

    def rows(self, ctx: BuildContext, schedule: Schedule) -> Rows:
        times, n_sessions = schedule.draw(ctx.rng_arrivals)
        if ctx.options.input_len is not None and self.path is not None:
            raise WorkloadError("ShareGPT sessions keep their messages' lengths; drop input_len.")
        synthetic, text = True, ""
        if self.path is not None or ctx.options.dataset_path is not None:
            ins, outs, prompts, turns, text = self._sharegpt(ctx, n_sessions)
            synthetic = False
        else:
            turns_dist = ctx.dist(self.turns, self.where / "turns")
            turns = turns_dist.sample(n_sessions, ctx.rng_lengths)
            ins, outs = ctx.lengths(int(turns.sum()), self.input, self.output, self.where)
            prompts = plain_prompts(ctx.synth, ins, ctx.rng_prompts, ctx.check)
            ctx.info["turns"] = turns_dist.describe()
        n = len(prompts)
        if self.think_ms == 0:
            think = np.zeros(n)
            ctx.info["think_ms"] = 0
        else:
            dist = ctx.dist(self.think_ms, self.where / "think_ms")
            think = dist.sample(n, ctx.rng_arrivals).astype(np.float64)
            ctx.info["think_ms"] = dist.describe()
        ctx.info["sessions"] = n_sessions
        columns = _columns(np.asarray(turns, dtype=np.int64), think)
        return Rows(
            columns.row_times(times),
            ins,
            outs,
            schedule.process.describe() | {"of": "sessions"},
            prompts=iter([(prompts, None)]),
            sessions=columns,
            synthetic=synthetic,
            source_text=text,
        )

    def _sharegpt(self, ctx: BuildContext, n_sessions: int):
        path = ctx.dataset(self.path)
        conversations, reused = load_sharegpt_conversations(
            path,
            num_conversations=n_sessions,
            seed=ctx.seed,
            max_turns=self.max_turns,
            shuffle=self.shuffle,
        )
        users = [u for conv in conversations for u, _ in conv]
        user_ids = encode_many(ctx.tokenizer, users)
        if ctx.options.output_len is not None or self.output is not None:
            spec = ctx.options.output_len or self.output
            outs = ctx.dist(spec, self.where / "output").sample(len(users), ctx.rng_lengths)
        else:
            answers = [a for conv in conversations for _, a in conv]
            outs = np.maximum([len(ids) for ids in encode_many(ctx.tokenizer, answers)], 1)
        ctx.info["sharegpt_file"] = {"path": str(path), "reused_conversations": reused}
        prompts = [
            Prompt(text, np.asarray(ids, dtype=np.int64))
            for text, ids in zip(users, user_ids, strict=True)
        ]
        empty = [i for i, p in enumerate(prompts) if len(p.token_ids) == 0]
        if empty:
            raise WorkloadError(f"{path}: a human turn is empty (conversation turn {empty[0]}).")
        ins = np.asarray([len(p.token_ids) for p in prompts], dtype=np.int64)
        turns = np.asarray([len(c) for c in conversations], dtype=np.int64)
        text = f"ShareGPT conversations from {path}, every turn"
        return ins, np.asarray(outs, dtype=np.int64), prompts, turns, text
