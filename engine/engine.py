"""The engine: validate and queue requests; each step is schedule, run, update, the same for every policy."""
import time
from dataclasses import replace

from engine.policies import make_scheduler
from engine.request import Request, RequestError, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import StepEvent


class LLMEngine:
    def __init__(self, hf_model, policy_cfg, seat_tokens: int, eos_ids=(), cache: str = "slot", seed: int = 0,
                 clock=time.perf_counter, runner=None, compile: bool = False):
        """runner: a ready runner (the simulator's) instead of a ModelRunner over hf_model; compile: run steps of
        decodes only through torch.compile (FlatModel.forward)."""
        self.scheduler = make_scheduler(policy_cfg, seat_tokens, eos_ids)
        self.runner = runner or ModelRunner(hf_model, self.scheduler.seats.num_seats, seat_tokens, cache, seed, eos_ids,
                                            compile)
        self.seat_tokens = seat_tokens
        self.vocab_size = self.runner.vocab_size
        self.clock = clock
        self.t0 = clock()
        self.steps: list[dict] = []   # one record per forward pass: start, duration (s), kind, token counts

    def now(self) -> float:
        """Seconds since the engine was made."""
        return self.clock() - self.t0

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, arrival: float | None = None) -> Request:
        """Validate and queue; raises RequestError naming the field and the limit, admitting nothing."""
        if rid in self.scheduler.requests:
            raise RequestError("request_id", f"{rid!r} is already in the engine")
        self.validate(prompt, params)
        req = Request(rid, list(prompt), params, self.now() if arrival is None else arrival)
        self.scheduler.add(req)
        return req

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the engine would refuse this request; reads only fixed limits (thread-safe)."""
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt", "must be a non-empty list of token ids")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise RequestError("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        if len(prompt) + params.max_new_tokens > self.seat_tokens:
            raise RequestError("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                               f"({params.max_new_tokens}) = {len(prompt) + params.max_new_tokens} exceeds "
                               f"seat_tokens = {self.seat_tokens} (tokens per seat)")

    def abort(self, rid: str) -> StepEvent | None:
        event = self.scheduler.abort(rid, self.now())
        self.runner.sampler.forget(rid)
        return event

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def wake_time(self) -> float | None:
        """When an idle scheduler would launch on its own (a batching deadline), on the engine clock."""
        return self.scheduler.wake_time(self.now())

    def step(self) -> list[StepEvent]:
        """One iteration; returns an event per new token (and per finish). Empty when nothing could run."""
        start = self.now()
        plan = self.scheduler.schedule(start)
        if not plan.chunks:
            return []
        reqs = self.scheduler.requests
        params = {c.rid: reqs[c.rid].params for c in plan.chunks if c.sample}
        seen = {rid: (reqs[rid].prompt, reqs[rid].output) for rid, p in params.items() if p.penalized}
        sampled = self.runner.run(plan, params, seen)
        end = self.now()
        events = self.scheduler.update(plan, sampled, end)
        if any(p.logprobs is not None for p in params.values()):
            lps = self.runner.logprobs
            events = [replace(e, logprob=lps[e.rid][0], top_logprobs=lps[e.rid][1]) if e.rid in lps else e
                      for e in events]
        for e in events:
            if e.finish_reason:
                self.runner.sampler.forget(e.rid)
        self.steps.append({"start": start, "duration": end - start, "kind": plan.kind,
                           "num_tokens": plan.total_tokens, "num_pad_tokens": plan.num_pad_tokens,
                           "useful_rows": plan.num_useful_rows,
                           "computed_rows": plan.num_sampled_rows, "num_new": len(plan.new_ids), **plan.features()})
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """All prompts arrive now; step until every one is done; return each one's output tokens."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(f"g{len(self.steps)}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        while self.has_work():
            self.step()
        return [r.output for r in reqs]
