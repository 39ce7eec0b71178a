"""Multi-turn sessions: conversations of T turns, one RequestSpec row per turn.

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

from dataclasses import dataclass
from typing import Any

import numpy as np

from workloads.assemble import plain_prompts
from workloads.loaders import load_sharegpt_conversations
from workloads.prompts import Prompt, encode_many
from workloads.schema import WorkloadError


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


def session_rows(
    builder: Any, n_sessions: int
) -> tuple[np.ndarray, np.ndarray, list[Prompt], SessionColumns]:
    """Input lengths, output lengths, user-message prompts and session columns of
    `n_sessions` sessions, for `workloads.build`'s builder (its spec, overrides and streams)."""
    source, opts = builder.source, builder.opts
    if opts.input_len is not None and "path" in source:
        raise WorkloadError("ShareGPT sessions keep their messages' lengths; drop input_len.")
    think_spec = source.get("think_ms", 0)
    if "path" in source or opts.dataset_path is not None:
        ins, outs, prompts, turns = _sharegpt(builder, n_sessions)
    else:
        turns = builder.dist(source["turns"], "source.turns").sample(n_sessions, builder.rng_len)
        n = int(turns.sum())
        ins, outs = builder.synthetic_lengths(n, source["input"], source["output"], "source")
        prompts = plain_prompts(builder.synth, ins, builder.rng_prompt, builder.check)
        builder.info["turns"] = builder.dist(source["turns"], "source.turns").describe()
    n = len(prompts)
    if think_spec == 0:
        think = np.zeros(n)
        builder.info["think_ms"] = 0
    else:
        dist = builder.dist(think_spec, "source.think_ms")
        think = dist.sample(n, builder.rng_arr).astype(np.float64)
        builder.info["think_ms"] = dist.describe()
    builder.info["sessions"] = n_sessions
    return ins, outs, prompts, _columns(np.asarray(turns, dtype=np.int64), think)


def _sharegpt(builder: Any, n_sessions: int):
    path = builder.path(builder.opts.dataset_path or builder.source.get("path"))
    conversations, reused = load_sharegpt_conversations(
        path,
        num_conversations=n_sessions,
        seed=builder.seed,
        max_turns=builder.source.get("max_turns"),
        shuffle=bool(builder.source.get("shuffle", True)),
    )
    users = [u for conv in conversations for u, _ in conv]
    user_ids = encode_many(builder.tok, users)
    if builder.opts.output_len is not None or "output" in builder.source:
        spec = builder.opts.output_len or builder.source["output"]
        d_out = builder.dist(spec, "source.output")
        outs = d_out.sample(len(users), builder.rng_len)
    else:
        answers = [a for conv in conversations for _, a in conv]
        outs = np.maximum([len(ids) for ids in encode_many(builder.tok, answers)], 1)
    builder.synthetic = False
    builder.source_text = f"ShareGPT conversations from {path}, every turn"
    builder.info["sharegpt_file"] = {"path": str(path), "reused_conversations": reused}
    prompts = [
        Prompt(text, np.asarray(ids, dtype=np.int64))
        for text, ids in zip(users, user_ids, strict=True)
    ]
    empty = [i for i, p in enumerate(prompts) if len(p.token_ids) == 0]
    if empty:
        raise WorkloadError(f"{path}: a human turn is empty (conversation turn {empty[0]}).")
    ins = np.asarray([len(p.token_ids) for p in prompts], dtype=np.int64)
    turns = np.asarray([len(c) for c in conversations], dtype=np.int64)
    return ins, np.asarray(outs, dtype=np.int64), prompts, turns
