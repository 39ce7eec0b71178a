"""Dataset and trace loaders: ShareGPT JSON, Azure LLM inference CSV, BurstGPT CSV, Mooncake JSONL.

Trace loaders return `TraceRecords` (timestamps in seconds, token counts, optional Mooncake
hash ids). A malformed row raises `WorkloadError` naming the file and line, unless
`skip_malformed` is set, in which case it is skipped and counted in `skipped_rows`.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from workloads.prompts import encode_many
from workloads.schema import WorkloadError

TRACE_FORMATS = ("azure", "burstgpt", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRecords:
    """Rows of a trace, in file order. `timestamps_s` are seconds (absolute or relative);
    `hash_ids` (Mooncake) lists one id per 512-token prompt block."""

    source: str
    timestamps_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_ids: list[list[int]] | None = None
    skipped_rows: int = 0
    dropped_failed: int = 0
    filtered_rows: int = 0

    def __len__(self) -> int:
        return len(self.input_tokens)


def _open_checked(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"Trace file {path} does not exist.")
    return path


def _parse_azure_time(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> POSIX seconds (naive, as UTC)."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    seconds = (base - datetime(1970, 1, 1)).total_seconds()
    return seconds + (float("0." + frac) if frac else 0.0)


class _RowErrors:
    def __init__(self, path: Path, skip: bool) -> None:
        self.path, self.skip, self.count = path, skip, 0

    def bad(self, line_no: int, reason: str) -> None:
        if not self.skip:
            raise WorkloadError(
                f"{self.path}:{line_no}: {reason} (pass skip_malformed to skip such rows)."
            )
        self.count += 1


def _read_csv(path: Path, required: tuple[str, ...]) -> tuple[csv.DictReader, Any]:
    fh = path.open(newline="", encoding="utf-8")
    reader = csv.DictReader(fh)
    header = [h.strip() for h in reader.fieldnames or []]
    missing = [c for c in required if c not in header]
    if missing:
        fh.close()
        raise WorkloadError(
            f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(required)}."
        )
    reader.fieldnames = header
    return reader, fh


def _count(value: str | None, *, allow_zero: bool = False) -> int:
    number = float(value)  # type: ignore[arg-type]
    if number != int(number) or number < (0 if allow_zero else 1):
        raise ValueError(value)
    return int(number)


def _arrow_csv(path: Path, column_types: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """Columns of a well-formed CSV read with pyarrow (fast); None when any row is malformed
    or null, so the caller falls back to its row-by-row reader, which names the bad line."""
    try:
        table = pacsv.read_csv(
            path,
            convert_options=pacsv.ConvertOptions(
                column_types=column_types, include_columns=list(column_types)
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError):
        return None
    if any(table.column(c).null_count for c in column_types):
        return None
    out = {}
    for c in column_types:
        col = table.column(c)
        if pa.types.is_timestamp(col.type):
            out[c] = col.cast(pa.int64()).to_numpy() / 1e9
        else:
            out[c] = col.to_numpy()
    return out


def load_azure(path: Path, *, skip_malformed: bool = False) -> TraceRecords:
    """Azure LLM inference trace 2023 CSV: TIMESTAMP,ContextTokens,GeneratedTokens."""
    path = _open_checked(path)
    cols = {
        "TIMESTAMP": pa.timestamp("ns"),
        "ContextTokens": pa.int64(),
        "GeneratedTokens": pa.int64(),
    }
    fast = _arrow_csv(path, cols)
    if (
        fast is not None
        and min(fast["ContextTokens"].min(initial=1), fast["GeneratedTokens"].min(initial=1)) >= 1
    ):
        return TraceRecords(
            str(path), fast["TIMESTAMP"], fast["ContextTokens"], fast["GeneratedTokens"]
        )
    return _azure_rows(path, skip_malformed)


def _azure_rows(path: Path, skip_malformed: bool) -> TraceRecords:
    errors = _RowErrors(path, skip_malformed)
    ts, ins, outs = [], [], []
    reader, fh = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    with fh:
        for i, row in enumerate(reader):
            line_no = i + 2
            try:
                t = _parse_azure_time(row["TIMESTAMP"])
                n_in, n_out = _count(row["ContextTokens"]), _count(row["GeneratedTokens"])
            except (ValueError, TypeError, AttributeError):
                errors.bad(line_no, f"malformed row {row!r}")
                continue
            ts.append(t)
            ins.append(n_in)
            outs.append(n_out)
    return TraceRecords(
        str(path), np.asarray(ts), np.asarray(ins), np.asarray(outs), skipped_rows=errors.count
    )


BURSTGPT_COLUMNS = (
    "Timestamp",
    "Model",
    "Request tokens",
    "Response tokens",
    "Total tokens",
    "Log Type",
)


def load_burstgpt(
    path: Path,
    *,
    skip_malformed: bool = False,
    model: str | None = None,
    log_type: str | None = None,
) -> TraceRecords:
    """BurstGPT CSV: Timestamp (s), Model, Request tokens, Response tokens, Total tokens,
    Log Type. Failed requests (0 response tokens) are dropped and counted in `dropped_failed`.
    `model` / `log_type` keep only matching rows (vLLM's loader keeps `model="GPT-4"`), the
    others counted in `filtered_rows`."""
    path = _open_checked(path)
    cols = {
        "Timestamp": pa.float64(),
        "Model": pa.string(),
        "Request tokens": pa.int64(),
        "Response tokens": pa.int64(),
        "Log Type": pa.string(),
    }
    fast = _arrow_csv(path, cols)
    if fast is not None:
        n_in, n_out = fast["Request tokens"], fast["Response tokens"]
        keep = np.ones(len(n_in), dtype=bool)
        if model is not None:
            keep &= fast["Model"] == model
        if log_type is not None:
            keep &= fast["Log Type"] == log_type
        ok = keep & (n_out > 0)
        if n_in[ok].min(initial=1) >= 1 and n_out.min(initial=0) >= 0:
            return TraceRecords(
                str(path),
                fast["Timestamp"][ok],
                n_in[ok],
                n_out[ok],
                dropped_failed=int((keep & (n_out <= 0)).sum()),
                filtered_rows=int((~keep).sum()),
            )
    return _burstgpt_rows(path, skip_malformed, model, log_type)


def _burstgpt_rows(
    path: Path, skip_malformed: bool, model: str | None = None, log_type: str | None = None
) -> TraceRecords:
    errors = _RowErrors(path, skip_malformed)
    ts, ins, outs = [], [], []
    failed = filtered = 0
    reader, fh = _read_csv(path, BURSTGPT_COLUMNS)
    with fh:
        for i, row in enumerate(reader):
            line_no = i + 2
            if (model is not None and row["Model"] != model) or (
                log_type is not None and row["Log Type"] != log_type
            ):
                filtered += 1
                continue
            try:
                t = float(row["Timestamp"])
                n_in = _count(row["Request tokens"], allow_zero=True)
                n_out = _count(row["Response tokens"], allow_zero=True)
            except (ValueError, TypeError):
                errors.bad(line_no, f"malformed row {row!r}")
                continue
            if n_out == 0:
                failed += 1
                continue
            if n_in == 0:
                errors.bad(line_no, "a request with 0 request tokens")
                continue
            ts.append(t)
            ins.append(n_in)
            outs.append(n_out)
    return TraceRecords(
        str(path),
        np.asarray(ts),
        np.asarray(ins),
        np.asarray(outs),
        skipped_rows=errors.count,
        dropped_failed=failed,
        filtered_rows=filtered,
    )


def load_mooncake(path: Path, *, skip_malformed: bool = False) -> TraceRecords:
    """Mooncake JSONL: one object a line with `timestamp` (ms), `input_length`,
    `output_length` and `hash_ids` (one id per 512-token block, ceil(input_length / 512) ids)."""
    path = _open_checked(path)
    errors = _RowErrors(path, skip_malformed)
    ts, ins, outs, hashes = [], [], [], []
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            line_no = i + 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t = float(obj["timestamp"]) / 1000.0
                n_in, n_out = _count(obj["input_length"]), _count(obj["output_length"])
                ids = [int(h) for h in obj["hash_ids"]]
            except (ValueError, TypeError, KeyError) as exc:
                errors.bad(line_no, f"malformed record ({exc.__class__.__name__}: {exc})")
                continue
            need = -(-n_in // MOONCAKE_BLOCK_TOKENS)
            if len(ids) != need:
                errors.bad(
                    line_no, f"{len(ids)} hash_ids for input_length {n_in} (expected {need})"
                )
                continue
            ts.append(t)
            ins.append(n_in)
            outs.append(n_out)
            hashes.append(ids)
    return TraceRecords(
        str(path),
        np.asarray(ts),
        np.asarray(ins),
        np.asarray(outs),
        hash_ids=hashes,
        skipped_rows=errors.count,
    )


def load_trace(
    fmt: str, path: Path, *, skip_malformed: bool = False, **filters: str | None
) -> TraceRecords:
    """Dispatch on `fmt` (azure, burstgpt, mooncake); `filters` (model, log_type) are
    BurstGPT's."""
    loaders = {"azure": load_azure, "burstgpt": load_burstgpt, "mooncake": load_mooncake}
    if fmt not in loaders:
        raise WorkloadError(f"Unknown trace format {fmt!r}; known: {', '.join(TRACE_FORMATS)}.")
    given = {k: v for k, v in filters.items() if v is not None}
    if given and fmt != "burstgpt":
        raise WorkloadError(f"Trace format {fmt!r} takes no {', '.join(sorted(given))} filter.")
    return loaders[fmt](Path(path), skip_malformed=skip_malformed, **given)


# -- ShareGPT -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShareGPTRules:
    """vLLM's `vllm bench serve --dataset-name sharegpt` rules (each configurable): drop
    conversations with fewer than 2 turns, shuffle with Python's `random` seeded like vLLM,
    first turn = prompt, second turn's token count = output length, keep prompt in
    [min_prompt_tokens, max_prompt_tokens], output >= min_output_tokens (not checked when the
    output length is fixed by an override) and prompt + output <= max_total_tokens."""

    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 1024
    min_output_tokens: int = 4
    max_total_tokens: int = 2048
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens <= self.max_total_tokens:
            raise WorkloadError(
                "ShareGPT rules need 1 <= min_prompt <= max_prompt <= max_total tokens."
            )
        if self.min_output_tokens < 1:
            raise WorkloadError("ShareGPT min_output_tokens must be at least 1.")


@dataclass(frozen=True)
class ShareGPTSample:
    prompts: list[str]
    prompt_token_ids: list[list[int]]
    output_tokens: list[int]
    source: str
    considered: int = 0
    filtered_out: int = 0
    oversampled: int = 0
    skipped_rows: int = 0
    notes: list[str] = field(default_factory=list)


def _turn_text(turn: Any) -> str:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise ValueError("turn without a string 'value'")
    return turn["value"]


def _sharegpt_entries(path: Path, errors: _RowErrors) -> list[tuple[int, list]]:
    """`(index, conversations)` of every entry with at least two turns."""
    if not path.is_file():
        raise WorkloadError(f"ShareGPT file {path} does not exist.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: a ShareGPT file holds a JSON list of conversations.")
    entries = []
    for i, entry in enumerate(data):
        convs = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(convs, list):
            errors.bad(i, f"entry {i} has no 'conversations' list")
            continue
        if len(convs) >= 2:
            entries.append((i, convs))
    return entries


def load_sharegpt_conversations(
    path: Path,
    *,
    num_conversations: int,
    seed: int,
    max_turns: int | None = None,
    shuffle: bool = True,
    skip_malformed: bool = False,
) -> tuple[list[list[tuple[str, str]]], int]:
    """`num_conversations` ShareGPT conversations with all their turns, each a list of
    (user message, recorded answer) pairs in order: a human turn followed by a gpt turn is one
    pair; leading gpt turns, a last unanswered human turn and other roles are left out, as is a
    conversation with no pair. Shuffled with Python's `random` seeded like vLLM's sampler;
    when fewer qualify, they are reused in order. Returns the conversations and how many were
    reused."""
    path = Path(path)
    errors = _RowErrors(path, skip_malformed)
    entries = _sharegpt_entries(path, errors)
    if shuffle:
        random.Random(seed).shuffle(entries)
    found: list[list[tuple[str, str]]] = []
    for i, convs in entries:
        pairs: list[tuple[str, str]] = []
        try:
            for a, b in zip(convs, convs[1:], strict=False):
                if a.get("from") == "human" and b.get("from") == "gpt":
                    pairs.append((_turn_text(a), _turn_text(b)))
        except (ValueError, AttributeError):
            errors.bad(i, f"entry {i} has a turn without a string 'value'")
            continue
        if pairs:
            found.append(pairs[:max_turns] if max_turns else pairs)
        if len(found) == num_conversations:
            break
    if not found:
        raise WorkloadError(f"No conversation in {path} has a human turn answered by a gpt turn.")
    reused = num_conversations - len(found)
    return [found[k % len(found)] for k in range(num_conversations)], max(reused, 0)


def load_sharegpt(
    path: Path,
    *,
    tokenizer: Any,
    num_requests: int,
    seed: int,
    rules: ShareGPTRules = ShareGPTRules(),
    output_len: int | None = None,
    skip_malformed: bool = False,
) -> ShareGPTSample:
    """Sample `num_requests` (prompt, output length) pairs from a ShareGPT JSON file with
    vLLM's rules; if fewer pass, draw the rest again at random (seeded), as vLLM does."""
    path = Path(path)
    errors = _RowErrors(path, skip_malformed)
    entries = _sharegpt_entries(path, errors)
    if rules.shuffle:
        random.Random(seed).shuffle(entries)
    prompts: list[str] = []
    prompt_ids: list[list[int]] = []
    outputs: list[int] = []
    considered = 0
    chunk = max(64, num_requests)
    pos = 0
    while len(prompts) < num_requests and pos < len(entries):
        batch = entries[pos : pos + chunk]
        pos += len(batch)
        texts: list[tuple[str, str]] = []
        for i, convs in batch:
            try:
                texts.append((_turn_text(convs[0]), _turn_text(convs[1])))
            except ValueError:
                errors.bad(i, f"entry {i} has a turn without a string 'value'")
        p_ids = encode_many(tokenizer, [p for p, _ in texts])
        c_ids = encode_many(tokenizer, [c for _, c in texts]) if output_len is None else None
        for k, (prompt, _) in enumerate(texts):
            if len(prompts) >= num_requests:
                break
            considered += 1
            n_in = len(p_ids[k])
            n_out = output_len if c_ids is None else len(c_ids[k])
            if n_in < rules.min_prompt_tokens or n_in > rules.max_prompt_tokens:
                continue
            if output_len is None and n_out < rules.min_output_tokens:
                continue
            if n_in + n_out > rules.max_total_tokens:
                continue
            prompts.append(prompt)
            prompt_ids.append(list(p_ids[k]))
            outputs.append(int(n_out))
    if not prompts:
        raise WorkloadError(f"No conversation in {path} passes the ShareGPT length rules.")
    oversampled = num_requests - len(prompts)
    if oversampled > 0:
        rng = random.Random(seed)
        picks = [rng.randrange(len(prompts)) for _ in range(oversampled)]
        prompts += [prompts[j] for j in picks]
        prompt_ids += [prompt_ids[j] for j in picks]
        outputs += [outputs[j] for j in picks]
    return ShareGPTSample(
        prompts=prompts,
        prompt_token_ids=prompt_ids,
        output_tokens=outputs,
        source=str(path),
        considered=considered,
        filtered_out=considered - (num_requests - max(oversampled, 0)),
        oversampled=max(oversampled, 0),
        skipped_rows=errors.count,
    )
