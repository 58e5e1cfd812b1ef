"""The model half of the engine: the forward pass, its weights and linear storages, attention paths, KV caches,
the sampler, the runner that turns a plan into a step, and the Hugging Face loader and reference."""
