"""The batching engine: requests, scheduler + policies, KV caches, model runner, sampler."""
from engine.core.outputs import StepEvent, StepRecord
from engine.core.request import Request, RequestError, SamplingParams

__all__ = ["LLMEngine", "Request", "RequestError", "SamplingParams", "StepEvent", "StepRecord"]


def __getattr__(name: str):
    """LLMEngine (torch and the model) is imported when asked for: engine.core and engine.specs stay light."""
    if name == "LLMEngine":
        from engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
