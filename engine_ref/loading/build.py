"""`build_engine`: load the model a config names and build the reference engine over it.

The engine core takes models already loaded and imports nothing from `engine_ref.loading`;
this is the one place that joins the two (exported as `engine_ref.build_engine`).
"""

from __future__ import annotations

from typing import Any

from engine_ref.core.block_manager import HashFn, default_hash
from engine_ref.core.engine import LLMEngine
from engine_ref.core.engine_config import EngineConfig
from engine_ref.core.model_runner import prepare_device, release_freed_heap
from engine_ref.core.quant import INT4_MODES
from engine_ref.loading.auto_dtype import resolve_auto_dtype
from engine_ref.loading.weights import load_model

__all__ = ["build_engine"]


def build_engine(
    config: EngineConfig,
    *,
    hash_fn: HashFn = default_hash,
    loaded: Any = None,
    draft_loaded: Any = None,
) -> LLMEngine:
    """The reference engine for `config`, loading `config.model` (unless `loaded` is given)
    and, for a `draft_model` speculative config, its draft model (unless `draft_loaded` is).
    `dtype="auto"` is resolved first (`auto_dtype`: measured once per model and machine, then
    cached); `engine.config.dtype_choice` says what it became and why.
    Raises EngineError when CUDA is asked for and missing (before anything loads) or the
    engine cannot be built, and ModelFileError when a model cannot be loaded."""
    prepare_device(config)  # torch's threads are set before loading, which uses them
    config, loaded = resolve_auto_dtype(config, loaded)
    dtype = config.torch_dtype()
    if loaded is None:
        loaded = load_model(config.model, dtype=dtype, keep_int4=config.quantization in INT4_MODES)
    spec = config.speculative_config
    if draft_loaded is None and spec is not None and spec.method == "draft_model":
        draft_loaded = load_model(spec.model, dtype=dtype)
    engine = LLMEngine(config, loaded=loaded, hash_fn=hash_fn, draft_loaded=draft_loaded)
    # Loading freed hundreds of MB of temporaries in the middle of the malloc heap, and the
    # state dicts go with this frame: hand the pages back.
    del loaded, draft_loaded
    release_freed_heap()
    return engine
