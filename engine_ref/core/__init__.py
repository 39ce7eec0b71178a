"""The engine core: `LLMEngine`, its model runner and output processor, scheduler, block manager,
sequences, sampler, attention and model. Nothing here knows about HTTP or model files: models
come in already loaded (`engine_ref.build_engine` loads them through `engine_ref.loading`)."""
