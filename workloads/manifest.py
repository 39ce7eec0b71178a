"""A built workload's manifest: what was built, from what, how (generator, spec, overrides and
effective parameters), for which tokenizer, and the sha256 of its table."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from workloads.schedule import Schedule
from workloads.schema import SHA256_BATCHED, SHA256_ONE_BATCH
from workloads.sources import BuildContext, Rows
from workloads.spec import WorkloadSpec
from workloads.tools import manifest_entry

FORMAT_VERSION = 3  # 2: Mooncake blocks tagged by id, streamed builds; 3: tenant, deadline_ms
SYNTHETIC_TEXT = "synthetic: lengths from distributions, prompts from the bundled corpus"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short sha256 over the ids of a probe text: tells apart tokenizers sharing a name."""
    probe = "The quick brown fox, 1234 tokens; naïve café — déjà vu!\n\tdef f(x): return x"
    ids = list(tokenizer.encode(probe))
    return hashlib.sha256(repr(ids).encode()).hexdigest()[:16]


def build_manifest(
    spec: WorkloadSpec,
    ctx: BuildContext,
    schedule: Schedule,
    rows: Rows,
    *,
    num_requests: int,
    sha256: str,
) -> dict[str, Any]:
    """The manifest of a finished build (its prompt chunks consumed, so that `ctx` holds the
    whole prompt check), JSON-safe: infinities as "inf", numpy scalars as Python numbers."""
    opts = ctx.options
    endpoint = opts.endpoint or spec.endpoint
    manifest = {
        "format_version": FORMAT_VERSION,
        "generator": f"workloads.{spec.source.kind}",
        "name": spec.name,
        "origin": spec.origin,
        "description": spec.description,
        "seed": ctx.seed,
        "tokenizer": getattr(ctx.tokenizer, "name", type(ctx.tokenizer).__name__),
        "tokenizer_fingerprint": tokenizer_fingerprint(ctx.tokenizer),
        "synthetic": rows.synthetic,
        "source": rows.source_text or SYNTHETIC_TEXT,
        "endpoint": endpoint,
        "prompt_format": _prompt_format(endpoint, rows.sessions is not None),
        "num_requests": num_requests,
        "num_sessions": len(rows.sessions.first_row) if rows.sessions is not None else None,
        "closed_loop_concurrency": schedule.closed_loop_concurrency,
        "duration_s": schedule.duration_s,
        "constraint": spec.constraint,
        "tools": manifest_entry(spec.tools, spec.tool_choice, rows.tools, endpoint),
        "parameters": {"spec": spec.data, "overrides": opts.overrides(), "effective": ctx.info},
        "prompt_check": ctx.check.as_dict() | {"notes": ctx.check.notes},
        "sha256": sha256,
        "sha256_of": SHA256_BATCHED if rows.streamed else SHA256_ONE_BATCH,
    }
    return _json_safe(manifest)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return _json_safe(float(value))
    return value


def _prompt_format(endpoint: str, sessions: bool) -> str:
    if sessions:
        return (
            "sessions: prompt is the turn's new user message; the harness sends it after the "
            "session's earlier turns and the engine's answers, and input_tokens counts it alone"
        )
    if endpoint in ("chat", "responses", "messages"):
        return f"{endpoint}: prompt is the single user message; input_tokens counts its content, not the chat template"
    return "completions: prompt text as sent"
