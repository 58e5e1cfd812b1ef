"""The batching engine: requests, scheduler + policies, KV caches, model runner, sampler."""
from engine.core.outputs import StepEvent, StepRecord
from engine.core.request import Request, RequestError, SamplingParams
from engine.engine import LLMEngine

__all__ = ["LLMEngine", "Request", "RequestError", "SamplingParams", "StepEvent", "StepRecord"]
