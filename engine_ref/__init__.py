"""The bundled reference engine: a compact paged-KV Llama engine on CPU or CUDA.

The names below load on first use, so `engine_ref.loading`'s tokenizers (which the harness
uses to count tokens) import without torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CompletionOutput": "engine_ref.core.engine",
    "EngineError": "engine_ref.core.engine",
    "LLMEngine": "engine_ref.core.engine",
    "build_engine": "engine_ref.loading.build",
    "RequestOutput": "engine_ref.core.engine",
    "EngineConfig": "engine_ref.core.engine_config",
    "EngineConfigError": "engine_ref.core.engine_config",
    "SamplingParams": "engine_ref.core.engine_config",
    "QueueFullError": "engine_ref.core.scheduler",
    "EngineStats": "engine_ref.core.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_ref' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
