"""The bundled reference engine: a compact paged-KV Llama engine on CPU or CUDA."""

from engine_ref.core.engine import CompletionOutput, EngineError, LLMEngine, RequestOutput
from engine_ref.core.engine_config import EngineConfig, EngineConfigError, SamplingParams
from engine_ref.core.scheduler import QueueFullError
from engine_ref.core.stats import EngineStats

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "EngineConfigError",
    "EngineError",
    "EngineStats",
    "LLMEngine",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]
