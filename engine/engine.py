"""The engine: validate and queue requests; each step is schedule, run, update, the same for every policy."""
import itertools
import time

from engine import usage
from engine.core.kv_pools import make_pools
from engine.core.outputs import StepEvent, StepRecord
from engine.core.policies import make_scheduler
from engine.core.request import Request, RequestError, SamplingParams, check_request
from engine.kernels import choice as kernels
from engine.model.kv_cache import make_cache
from engine.model.runner import ModelRunner
from engine.specs import KVSpec, PolicySpec


class LLMEngine:
    def __init__(self, net, policy: PolicySpec, max_request_tokens: int, kv: KVSpec = KVSpec(), eos_ids=(),
                 seed: int = 0, clock=time.perf_counter, runner=None, compile: bool = False, graphs: bool = False,
                 speculation=None):
        """Built by engine/factory.py. net: the engine's model (engine/model/forward.py); max_request_tokens: prompt
        + output of one request (a seat's length on the slot cache); runner: a ready runner (the simulator's)
        instead of one over the net; compile: decode-only steps through torch.compile; graphs: those steps padded
        to few shapes (CUDA graphs on CUDA); speculation: drafts verified in the steps
        (engine.core.speculation.Speculation; iteration-level policies)."""
        usage.retain_freed_memory()  # each step's temporaries reuse the last step's memory
        self.scheduler = make_scheduler(policy, max_request_tokens, eos_ids)
        self.max_request_tokens = max_request_tokens
        if speculation is not None:
            self.scheduler.use_speculation(speculation)
        if kv.name == "paged":
            src = runner or net
            self.scheduler.use_blocks(make_pools(kv, self.scheduler.max_running, max_request_tokens,
                                                 src.kv_bytes_per_token, getattr(src, "windows", None)))
        if runner is None:
            seats = self.scheduler.seats.num_seats if self.scheduler.seats else 0
            runner = ModelRunner(net, make_cache(kv.name, net, seats, max_request_tokens, self.scheduler.blocks),
                                 seed, eos_ids, compile, graphs)
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.clock = clock
        self.t0 = clock()
        self.records: list[StepRecord] = []  # one per forward pass since the last take_records()
        self._generated = itertools.count()  # ids of generate()'s requests

    def now(self) -> float:
        """Seconds since the engine was made (or restarted)."""
        return self.clock() - self.t0

    def restart(self) -> None:
        """Zero the clock and drop the step records: a measured run starts here."""
        self.t0 = self.clock()
        self.records.clear()

    def skip_to(self, t: float) -> None:
        """Move the clock forward to engine time t (no earlier): for a replay whose engine can run nothing before t
        (no step to take until an arrival or a batching deadline), so that the idle gap costs no wall time."""
        self.t0 -= max(0.0, t - self.now())

    def take_records(self) -> list[StepRecord]:
        """The steps run since the last call, handed over (the engine keeps none)."""
        records, self.records = self.records, []
        return records

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestError if this engine would refuse the request; reads only fixed limits (thread-safe)."""
        check_request(prompt, params, self.vocab_size, self.max_request_tokens)
        pool, total = self.scheduler.blocks, len(prompt) + params.max_new_tokens
        if pool is not None and pool.blocks_for(total) > pool.admissible:
            raise RequestError("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                               f"({params.max_new_tokens}) = {total} tokens need {pool.blocks_for(total)} KV blocks "
                               f"of {pool.block_size}; the pool can admit {pool.admissible} for one request (the rest "
                               "is the watermark)")

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, arrival: float | None = None) -> Request:
        """Validate and queue; raises RequestError naming the field and the limit, admitting nothing."""
        if rid in self.scheduler.requests:
            raise RequestError("request_id", f"{rid!r} is already in the engine")
        self.validate(prompt, params)
        req = Request(rid, list(prompt), params, self.now() if arrival is None else arrival)
        self.scheduler.add(req)
        return req

    def abort(self, rid: str) -> StepEvent | None:
        return self.scheduler.abort(rid, self.now())

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def wake_time(self) -> float | None:
        """When an idle scheduler would launch on its own (a batching deadline), on the engine clock."""
        return self.scheduler.wake_time(self.now())

    def step(self) -> list[StepEvent]:
        """One iteration: an event per new token (and per finish); [] when nothing could run."""
        start = self.now()
        plan = self.scheduler.schedule(start)
        if not plan.chunks:
            return []
        out = self.runner.run(plan)
        end = self.now()
        self.records.append(StepRecord.of(plan, start, end))
        return self.scheduler.update(plan, out, end)

    @property
    def compiled(self) -> bool:
        """Whether some steps run through torch.compile (decode-only steps, compile on, any cache but paged)."""
        return bool(getattr(self.runner, "compile", False)) and self.scheduler.blocks is None

    def warm_up(self) -> float:
        """Compile, before the first request, every step shape that runs compiled: decodes of one row and, for each
        kernel row bucket up to the number of seats (with graphs: each power of two), of equal and unequal lengths.
        A scratch engine runs them on this engine's runner (its cache rows overwritten; this engine's requests and
        records untouched). Seconds spent; 0 when no step runs compiled."""
        if not self.compiled:
            return 0.0
        t = time.perf_counter()
        seats = self.scheduler.seats.num_seats
        sizes, low = set(), 1
        for i, top in enumerate(kernels.BUCKETS):  # rows low..top share each matrix's product (the last: all beyond)
            high = seats if i == len(kernels.BUCKETS) - 1 else min(top, seats)
            if high >= low:
                sizes.add(high)
            if high == seats and seats - 1 >= max(low, 2):
                sizes.add(seats - 1)  # fewer rows than seats: another graph than all seats decoding
            low = top + 1
        if self.runner.graphs:
            sizes |= {1 << k for k in range(seats.bit_length()) if 1 << k <= seats}
        scratch = LLMEngine(None, PolicySpec("continuous", seats), self.max_request_tokens,
                            runner=self.runner)
        n = max(1, min(8, self.max_request_tokens - 3))  # prompt tokens; 3 new ones: a prefill, then 2 decodes
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        for rows in sorted(sizes):
            for lens in [[n] * rows] + ([[1 + i % n for i in range(rows)]] if rows > 1 else []):
                scratch.generate([[(1 + j) % self.vocab_size for j in range(m)] for m in lens], params)
        return time.perf_counter() - t

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """All prompts arrive now; step until every one is done; return each one's output tokens."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(f"g{next(self._generated)}", p, sp) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return [r.output for r in reqs]
