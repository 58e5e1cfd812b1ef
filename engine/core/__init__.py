"""The scheduler half of the engine: requests, the step plan and its outputs, KV block bookkeeping, the policies
and the simulator's virtual runner. Plain Python: nothing here imports torch, engine.model or engine.kernels."""
