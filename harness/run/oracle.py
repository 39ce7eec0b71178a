"""The reference outputs behind the correctness oracle: each greedy request of a workload run
alone (batch 1) on the reference engine, in-process, computed once per workload and cached
beside the built workloads under `<cache>/oracle/`, keyed by the workload's sha256, its output
constraint (the reference decodes under it too), the model, the endpoint, the harness version
and the engine's dtype."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from bench_common.cache import CacheArea, cache_area
from harness.errors import HarnessError
from harness.http.events import CHAT_TEMPLATED
from slo.runrecord import Endpoint

ORACLE_FORMAT = 1


def is_greedy(row: dict) -> bool:
    """A RequestSpec row asks for greedy decoding (temperature 0)."""
    temperature = row.get("temperature")
    return temperature is not None and float(temperature) < 1e-5


def prompt_ids(tokenizer, row: dict, endpoint: Endpoint) -> list[int]:
    """The prompt's token ids as an OpenAI-compatible server builds them (chat: the model's chat
    template around one user message, as Responses and Messages servers render it too)."""
    text = row["prompt"]
    if endpoint in CHAT_TEMPLATED:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return list(tokenizer.encode(text))


def oracle_path(
    workload_sha256: str, model: str, endpoint: Endpoint, constraint: dict | None = None
) -> Path:
    import harness
    from workloads.store import cache_key

    key = cache_key(
        {
            "workload": workload_sha256,
            "model": model,
            "endpoint": endpoint.value,
            "harness": harness.__version__,
            "dtype": str(_engine_config(model).torch_dtype()),
            "format": ORACLE_FORMAT,
            **({"constraint": constraint} if constraint is not None else {}),
        }
    )
    return cache_area(CacheArea.ORACLE) / f"{workload_sha256[:16]}-{key[:16]}.json"


def reference_texts(
    rows: list[dict], *, model: str, endpoint: Endpoint, workload_sha256: str
) -> dict[str, str]:
    """`{request_id: output text}` of the reference engine for every greedy row, batch 1.

    Read from the cache when present; otherwise computed (one request at a time, so no batch
    effect can enter the reference) and written there atomically."""
    greedy = [r for r in rows if is_greedy(r)]
    if not greedy:
        return {}
    path = oracle_path(workload_sha256, model, endpoint, greedy[0].get("constraint"))
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            if set(cached["texts"]) >= {r["request_id"] for r in greedy}:
                return cached["texts"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # recompute a damaged entry
    texts = _compute(greedy, model=model, endpoint=endpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"model": model, "endpoint": endpoint.value, "texts": texts}))
    os.replace(tmp, path)
    return texts


def _guided(constraint: dict | None):
    """The reference engine's form of a workload constraint (None: unconstrained)."""
    if constraint is None:
        return None
    from engine_ref.core.grammar import GuidedDecoding
    from workloads.constraint import constraint_kind

    kind = constraint_kind(constraint)
    if kind == "json_schema":
        return GuidedDecoding.json_schema(constraint[kind])
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "choice":
        return GuidedDecoding("choice", choices=tuple(constraint[kind]))
    return GuidedDecoding(kind, constraint[kind])


@functools.lru_cache(maxsize=8)
def _engine_config(model: str):
    """The reference engine's config for `model` with its `auto` dtype resolved as a server
    of it would resolve it (measured once, then cached), so the oracle's texts are keyed by
    and computed in the dtype a managed reference server runs."""
    from engine_ref import EngineConfig
    from engine_ref.loading.auto_dtype import resolve_auto_dtype

    try:
        config, _ = resolve_auto_dtype(EngineConfig(model=model))
    except Exception as exc:  # the loader's errors are one sentence
        raise HarnessError(
            f"cannot load {model!r} on the reference engine for the output oracle: {exc}"
        ) from exc
    return config


def _compute(rows: list[dict], *, model: str, endpoint: Endpoint) -> dict[str, str]:
    from engine_ref import SamplingParams, build_engine

    try:
        engine = build_engine(_engine_config(model))
    except Exception as exc:  # the loader's errors are one sentence
        raise HarnessError(
            f"cannot load {model!r} on the reference engine for the output oracle: {exc}"
        ) from exc
    texts = {}
    for row in rows:
        params = SamplingParams(
            max_tokens=int(row["max_output_tokens"]),
            temperature=0.0,
            ignore_eos=bool(row.get("ignore_eos")),
            guided=_guided(row.get("constraint")),
        )
        ids = prompt_ids(engine.tokenizer, row, endpoint)
        engine.add_request(row["request_id"], ids, params)
        parts = []
        while engine.has_unfinished():
            for out in engine.step():
                parts += [o.new_text for o in out.outputs]
        texts[row["request_id"]] = "".join(parts)
    return texts
