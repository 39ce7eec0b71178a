"""Serving: the OpenAI-compatible HTTP server, request parsing and response rendering, the engine
loop that steps the engine off the event loop, Prometheus metrics and the `bench serve` and
`bench model` commands. The engine is reached only through `engine_ref.serving.interface`.
`python -m engine_ref.serving` runs the server (`bench serve`)."""
