"""The simulator: the real scheduler and engine, with a runner that advances a virtual clock by a fitted step-time cost
model instead of running the model. One scheduler, two clocks.

Cost model: step seconds = fixed + sum over FEATURES of coefficient x feature, the features being what the step
computes (SchedulerOutput.features): rows through the layers, rows through the LM head and sampler, query-key pairs
of the decode and of the prompt attention as computed (decode keys weigh at long contexts), whether the pass mixes
prompts and decodes, and whether it carries more than one row (on a CPU one row takes the matrix-vector kernels,
more rows the matrix-matrix ones: a jump in step time that no per-row cost describes). Every coefficient is >= 0.
A drafted token is one more decode row and sampled row, its queries in the prompt attention (the verification rows).

Speculative decoding simulates from measured rates: RateDrafter proposes k tokens on a measured share of the rows,
and SimRunner keeps each drafted token with a measured acceptance (per token, given the ones before it kept).
"""
import random
from dataclasses import dataclass, field

from engine.core.outputs import RunnerOutput, SchedulerOutput

FEATURES = ("num_prompt_tokens", "num_decode_rows", "num_sampled_rows", "decode_attention", "prompt_attention",
            "is_mixed", "multi_row")
UNITS = {"fixed": "s per step", "num_prompt_tokens": "s per prompt token", "num_decode_rows": "s per decode row",
         "num_sampled_rows": "s per sampled row", "decode_attention": "s per decode query-key pair",
         "prompt_attention": "s per prompt query-key pair", "is_mixed": "s per mixed step",
         "multi_row": "s per step of more than one row"}


@dataclass(frozen=True)
class CostModel:
    fixed: float                                               # s per step (the weights streamed once)
    coef: dict[str, float] = field(default_factory=dict)       # feature name -> s per unit (UNITS)

    def step_time(self, plan: SchedulerOutput) -> float:
        return self.predict(plan.features())

    def predict(self, features) -> float:
        """Seconds for a step with these feature values (a dict, a record row, or a StepRecord)."""
        get = features.__getitem__ if isinstance(features, dict) else lambda f: getattr(features, f)
        return self.fixed + sum(c * get(f) for f, c in self.coef.items())

    def as_dict(self) -> dict:
        return {"fixed": self.fixed, "coef": dict(self.coef)}


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
    """Same interface as ModelRunner: run(plan) -> RunnerOutput; costs virtual time, computes nothing.
    A paged KV pool is the scheduler's (engine.core.kv_blocks, model-free), so block budgets simulate as they run;
    kv_bytes_per_token sizes a pool given in MiB (kv.memory_mb), else give kv.num_blocks."""

    def __init__(self, cost: CostModel, clock: VirtualClock, vocab_size: int = 2**31 - 1,
                 kv_bytes_per_token: int | None = None, acceptance: float = 0.0, seed: int = 0):
        """acceptance: the chance a drafted token is kept once the ones before it in its row were."""
        self.cost, self.clock, self.vocab_size = cost, clock, vocab_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.acceptance, self._rng = acceptance, random.Random(seed)

    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        self.clock.advance(self.cost.step_time(plan))
        accepted = {}
        for c in plan.chunks:
            if c.draft:
                n = 0
                while n < len(c.draft) and self._rng.random() < self.acceptance:
                    n += 1
                accepted[c.rid] = c.draft[:n]
        # token 0: lengths come from the workload
        return RunnerOutput({c.rid: 0 for c in plan.chunks if c.sample}, accepted=accepted)


class RateDrafter:
    """A simulated drafter: with probability `rate` (the measured share of rows asked that got a draft) a draft of
    token 0s, `length` long on average (the measured mean: its floor or its ceiling), at most k; none otherwise;
    seeded (give the runner another seed: its acceptance draws are then not these)."""

    def __init__(self, rate: float, length: float, seed: int = 0):
        self.rate, self.length, self._rng = rate, length, random.Random(seed)

    def propose(self, req, k: int) -> tuple[int, ...]:
        if self._rng.random() >= self.rate:
            return ()
        n = int(self.length) + (self._rng.random() < self.length - int(self.length))
        return (0,) * min(k, max(1, n))

    def forget(self, rid: str) -> None:
        """Nothing is kept per request."""
