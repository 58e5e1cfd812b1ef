"""The batching engine: requests, scheduler + policies, KV caches, model runner, sampler."""
from engine.engine import LLMEngine
from engine.outputs import StepEvent, StepRecord
from engine.request import Request, RequestError, SamplingParams

__all__ = ["LLMEngine", "Request", "RequestError", "SamplingParams", "StepEvent", "StepRecord"]
