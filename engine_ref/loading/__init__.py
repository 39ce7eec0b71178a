"""Model files: GGUF and Hugging Face readers, weights, tokenizer, the model registry and fetch,
export, and the tiny-random model.

The one entry point for code outside `engine_ref` (the harness, workloads, benchmarks):

    from engine_ref.loading import load_model, load_tokenizer, ModelFileError

`load_tokenizer(name_or_path)` takes a reference model name (`smollm2-135m`, `tiny-random`), a
GGUF file or a Hugging Face directory and returns a tokenizer without loading any weights.
"""

from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.weights import LoadedModel, load_model, load_tokenizer

__all__ = ["LoadedModel", "ModelFileError", "load_model", "load_tokenizer"]
