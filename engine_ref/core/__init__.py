"""The engine core: `LLMEngine`, its scheduler, block manager, sequences, sampler, attention and
model. Nothing here knows about HTTP; model files come in through `engine_ref.loading`."""
