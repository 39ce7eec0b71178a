"""`EngineInterface` against the engines the server fronts: the reference engine (tiny-random) and
the test fake. Member names and signatures (parameter names, kinds and which have defaults) must
match the Protocol's, so a change on either side fails here before it fails in the server."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine

from engine_ref import EngineConfig, LLMEngine
from engine_ref.serving.interface import (
    EngineInterface,
    ServedConfig,
    ServedStats,
    ServedTokenizer,
)
from engine_ref.serving.metrics import ServerMetrics

# 512 blocks of 16 tokens.
SMALL_KV_BYTES = 512 * 16 * 1024


def _methods(protocol: type) -> dict[str, object]:
    return {
        name: member
        for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def _fields(protocol: type) -> set[str]:
    return set(vars(protocol).get("__annotations__", {}))


def _signature_drift(declared: object, actual: object) -> str | None:
    """Why a call the Protocol allows would fail on (or bind differently to) `actual`, or None.
    Every declared parameter must be there with its name, kind, position among the positional
    ones, and whether it has a default; `actual` may add parameters that have defaults."""
    want = list(inspect.signature(declared).parameters.values())
    have = list(inspect.signature(actual).parameters.values())
    have_by_name = {p.name: p for p in have}
    for index, p in enumerate(want):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            q = have[index] if index < len(have) else None
        else:
            q = have_by_name.get(p.name)
        if q is None or (q.name, q.kind) != (p.name, p.kind):
            return f"parameter {p.name!r} ({p.kind.description}) is missing or differs"
        if (q.default is q.empty) != (p.default is p.empty):
            return f"parameter {p.name!r} differs in having a default"
    declared_names = {p.name for p in want}
    for q in have:
        required = q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
        if q.name not in declared_names and required:
            return f"extra parameter {q.name!r} has no default"
    return None


def _mismatches(protocol: type, implementation: type) -> list[str]:
    """How `implementation`'s methods differ from `protocol`'s (missing, or another signature)."""
    found = []
    for name, declared in _methods(protocol).items():
        actual = getattr(implementation, name, None)
        if actual is None:
            found.append(f"{implementation.__name__}.{name} is missing")
        elif (why := _signature_drift(declared, actual)) is not None:
            found.append(
                f"{implementation.__name__}.{name}{inspect.signature(actual)}: {why} "
                f"(declared: {protocol.__name__}.{name}{inspect.signature(declared)})"
            )
    return found


@pytest.fixture(scope="module")
def real_engine(tiny_model):
    config = EngineConfig(
        model="tiny-random",
        dtype="float32",
        device="cpu",
        num_threads=1,
        kv_cache_memory_bytes=SMALL_KV_BYTES,
    )
    return LLMEngine(config, loaded=tiny_model)


@pytest.fixture(params=["LLMEngine", "FakeEngine"])
def engine(request, real_engine):
    return real_engine if request.param == "LLMEngine" else FakeEngine()


def test_the_protocol_declares_what_the_server_calls():
    assert set(_methods(EngineInterface)) == {
        "add_request",
        "step",
        "abort",
        "has_unfinished",
        "stats",
    }
    assert _fields(EngineInterface) == {"tokenizer", "config"}
    assert set(_methods(ServedTokenizer)) == {"encode", "decode", "apply_chat_template"}
    assert _fields(ServedTokenizer) == {"vocab_size"}
    assert _fields(ServedConfig) == {"model"}


@pytest.mark.parametrize("implementation", [LLMEngine, FakeEngine])
def test_engine_methods_match_the_protocol_signatures(implementation):
    assert _mismatches(EngineInterface, implementation) == []


def test_engines_satisfy_the_protocol_with_their_members(engine):
    assert isinstance(engine, EngineInterface)
    assert isinstance(engine.tokenizer, ServedTokenizer)
    assert _mismatches(ServedTokenizer, type(engine.tokenizer)) == []
    assert isinstance(engine.config, ServedConfig)
    assert isinstance(engine.config.model, str)
    stats = engine.stats()
    assert isinstance(stats, ServedStats)
    missing = [name for name in _fields(ServedStats) if not hasattr(stats, name)]
    assert missing == []


def test_metrics_need_no_stats_field_beyond_the_protocol():
    stats = SimpleNamespace(**dict.fromkeys(_fields(ServedStats), 0))
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'vllm:num_requests_running{model_name="m"} 0.0' in text


class _DriftedEngine(FakeEngine):
    def add_request(self, request_id, prompt, params, priority=0):  # renamed, not keyword-only
        super().add_request(request_id, prompt, params, priority=priority)

    def abort(self, request_id, reason):  # a new required parameter
        super().abort(request_id)

    def step(self, *, budget=None):  # a new optional parameter: callers are unaffected
        return super().step()


def test_a_drifted_signature_is_reported_and_an_added_option_is_not():
    found = _mismatches(EngineInterface, _DriftedEngine)
    assert len(found) == 2, found
    assert found[0].startswith("_DriftedEngine.add_request(self, request_id, prompt, params,")
    assert "'prompt_token_ids'" in found[0]
    assert found[1].startswith("_DriftedEngine.abort(self, request_id, reason)")
    assert "'reason' has no default" in found[1]
