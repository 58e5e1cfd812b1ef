"""The engine: validate and queue requests; each step is schedule, run, update, the same for every policy."""
import time
from dataclasses import replace

from engine import kernels
from engine.blocks import BlockManager
from engine.model import FlatModel
from engine.policies import make_scheduler
from engine.request import Request, RequestError, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import StepEvent

# conf/kv: each KV cache's fields and their defaults (slot: a row of seat_tokens per seat; cat: the same, grown by
# torch.cat; paged: blocks shared by all requests, see engine.blocks and BlockManager.sized)
KV = {"slot": {}, "cat": {},
      "paged": {"block_size": 16, "num_blocks": None, "memory_mb": None, "watermark": 0.01, "prefix_caching": True}}


def kv_config(kv) -> dict:
    """A conf/kv entry (or just its name) with every field; a bad name, field or value fails naming the valid ones."""
    kv = {"name": kv} if isinstance(kv, str) else dict(kv)
    name = kv.pop("name", None)
    if name not in KV:
        raise ValueError(f"unknown kv {name!r}; choose one of {sorted(KV)}")
    if set(kv) - set(KV[name]):
        raise ValueError(f"kv {name!r} has no field {sorted(set(kv) - set(KV[name]))}; it has {sorted(KV[name])}")
    kv = {"name": name, **KV[name], **kv}
    if name == "paged":
        bs, n, mb, wm = kv["block_size"], kv["num_blocks"], kv["memory_mb"], kv["watermark"]
        valid = {"block_size": (isinstance(bs, int) and bs >= 1, "an integer >= 1 (tokens)"),
                 "num_blocks": (n is None or (isinstance(n, int) and n >= 2), "null or an integer >= 2"),
                 "memory_mb": (mb is None or (isinstance(mb, (int, float)) and mb > 0), "null or > 0 (MiB)"),
                 "watermark": (isinstance(wm, (int, float)) and 0 <= wm < 1, "in [0, 1) (a fraction of the blocks)"),
                 "prefix_caching": (isinstance(kv["prefix_caching"], bool), "true or false")}
        for field, (ok, rule) in valid.items():
            if not ok:
                raise ValueError(f"kv.{field} = {kv[field]!r}: must be {rule}")
    return kv


class LLMEngine:
    def __init__(self, hf_model, policy_cfg, seat_tokens: int, eos_ids=(), kv="slot", seed: int = 0,
                 clock=time.perf_counter, runner=None, compile: bool = False, graphs: bool = False):
        """kv: "slot", "cat", "paged" or a conf/kv entry (kv_config); seat_tokens: the tokens a request may hold
        (prompt + max_new_tokens), on paged KV too; runner: a ready runner (the simulator's) instead of a
        ModelRunner over hf_model; compile: run steps of decodes only through torch.compile (FlatModel.forward);
        graphs: pad those steps to few shapes, captured as CUDA graphs on CUDA (ModelRunner)."""
        kv = kv_config(kv)
        self.scheduler = make_scheduler(policy_cfg, seat_tokens, eos_ids)
        pool = None
        if kv["name"] == "paged":
            per_token = FlatModel.of(hf_model).kv_bytes_per_token if runner is None else runner.kv_bytes_per_token
            blocks = BlockManager.sized(kv, self.scheduler.seats.num_seats, seat_tokens, per_token)
            self.scheduler.use_blocks(blocks)
            pool = (blocks.num_blocks, blocks.block_size)
        self.runner = runner or ModelRunner(hf_model, self.scheduler.seats.num_seats, seat_tokens, kv["name"], seed,
                                            eos_ids, compile, pool, graphs)
        self.seat_tokens = seat_tokens
        self.vocab_size = self.runner.vocab_size
        self.clock = clock
        self.t0 = clock()
        self.steps: list[dict] = []   # one record per forward pass: start, duration (s), kind, token counts,
        # prefix-cache hit tokens, preemptions, and on paged KV the blocks used and free

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
        total = len(prompt) + params.max_new_tokens
        if total > self.seat_tokens:
            raise RequestError("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                               f"({params.max_new_tokens}) = {total} exceeds "
                               f"seat_tokens = {self.seat_tokens} (tokens per seat)")
        blocks = getattr(self, "blocks", None)  # the paged pool; none on the generate workers that share this check
        if blocks is not None and blocks.blocks_for(total) > blocks.num_blocks - blocks.watermark:
            raise RequestError("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                               f"({params.max_new_tokens}) = {total} tokens need {blocks.blocks_for(total)} KV blocks "
                               f"of {blocks.block_size}; the pool has {blocks.num_blocks}, of which "
                               f"{blocks.num_blocks - blocks.watermark} can be admitted (the rest is the watermark)")

    @property
    def blocks(self):
        """The paged KV pool (engine.blocks.BlockManager), or None on a slot cache."""
        return self.scheduler.blocks

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
        pool = self.scheduler.blocks  # paged: the blocks held during this pass
        queried = pool.queried_tokens if pool is not None else 0
        plan = self.scheduler.schedule(start)
        if not plan.chunks:
            return []
        running = self.scheduler.running
        held = sum(r.num_computed + plan.num_scheduled_tokens.get(r.rid, 0) for r in running)  # K/V tokens after it
        if pool is None:
            kv = {"kv_reserved_tokens": len(running) * self.seat_tokens}
        else:
            kv = {"blocks_used": pool.num_used, "blocks_free": pool.num_free,
                  "kv_reserved_tokens": pool.num_used * pool.block_size, "queried_tokens": pool.queried_tokens - queried}
        kv.update(num_running=len(running), kv_tokens=held)
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
                           "computed_rows": plan.num_sampled_rows, "num_new": len(plan.new_ids),
                           "cached_tokens": sum(plan.num_cached_tokens.values()),
                           "preempted": len(plan.preempted_ids), **kv, **plan.features()})
        return events

    @property
    def compiled(self) -> bool:
        """Whether some steps run through torch.compile (decode-only steps, compile on, not on a paged cache)."""
        return bool(getattr(self.runner, "compile", False)) and self.scheduler.blocks is None

    def warm_up(self) -> float:
        """Compile now, not in the first requests' steps, every kind of step that runs compiled (FlatModel.forward):
        decode steps of one row and, for each kernel row bucket up to the seats (with graphs: each power of two),
        of rows of equal and of unequal lengths, all seats decoding or fewer. A scratch engine runs them on this
        engine's runner (its cache rows are overwritten; this engine's requests and records are untouched).
        Seconds spent; 0 when no step runs compiled (eager, or a paged cache)."""
        runner = self.runner
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
        if runner.graphs:
            sizes |= {1 << k for k in range(seats.bit_length()) if 1 << k <= seats}
        scratch = LLMEngine(None, {"name": "continuous", "max_seats": seats}, self.seat_tokens, runner=runner)
        n = max(1, min(8, self.seat_tokens - 3))  # prompt tokens; 3 new ones: a prefill step, then 2 decode steps
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        for rows in sorted(sizes):
            for lens in [[n] * rows] + ([[1 + i % n for i in range(rows)]] if rows > 1 else []):
                scratch.generate([[(1 + j) % self.vocab_size for j in range(m)] for m in lens], params)
        return time.perf_counter() - t

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """All prompts arrive now; step until every one is done; return each one's output tokens."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(f"g{len(self.steps)}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        while self.has_work():
            self.step()
        return [r.output for r in reqs]
