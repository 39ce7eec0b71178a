"""Exports of a run directory in formats other tools read: vLLM's result JSON (`vllm`), the
llm-d Benchmark Report (`llmd`) and one CSV row per request (`csv`)."""
