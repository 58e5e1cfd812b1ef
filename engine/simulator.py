"""The simulator: the real scheduler and engine, with a runner that advances a virtual clock by a fitted
step-time cost model instead of running the model. One scheduler, two clocks.

Cost model: step seconds = fixed + per_prompt_token x prompt tokens + per_decode_row x decode rows
                           + per_kv_token x keys attended.
"""
from dataclasses import asdict, dataclass

from engine.scheduler import SchedulerOutput

FEATURES = ("num_prompt_tokens", "num_decode_rows", "kv_tokens")


@dataclass(frozen=True)
class CostModel:
    fixed: float            # s per step (weights streamed once)
    per_prompt_token: float  # s per prompt token
    per_decode_row: float    # s per decode row
    per_kv_token: float      # s per key attended

    def step_time(self, num_prompt_tokens: int, num_decode_rows: int, kv_tokens: int) -> float:
        return (self.fixed + self.per_prompt_token * num_prompt_tokens + self.per_decode_row * num_decode_rows
                + self.per_kv_token * kv_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


class VirtualClock:
    """Seconds that pass only when told to."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += max(0.0, dt)

    def advance_to(self, t: float) -> None:
        """Jump to absolute time t (exact: a deadline waited for is reached, not missed by rounding)."""
        self.t = max(self.t, t)


class SimRunner:
    """Same interface as ModelRunner: run(plan, params) -> rid -> token; costs virtual time, computes nothing."""

    def __init__(self, cost: CostModel, clock: VirtualClock, vocab_size: int = 2**31 - 1):
        self.cost, self.clock, self.vocab_size = cost, clock, vocab_size
        self.sampler = _NoSampler()

    def run(self, out: SchedulerOutput, params: dict) -> dict[str, int]:
        prompt = sum(len(c.tokens) for c in out.chunks if c.prompt)
        decode = sum(1 for c in out.chunks if not c.prompt)
        kv = sum(c.start + len(c.tokens) for c in out.chunks)
        self.clock.advance(self.cost.step_time(prompt, decode, kv))
        return {c.rid: 0 for c in out.chunks if c.sample}  # token 0: lengths come from the workload


class _NoSampler:
    def forget(self, rid: str) -> None:
        pass
