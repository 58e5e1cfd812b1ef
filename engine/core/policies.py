"""The batching policies, one class each; `make_scheduler` builds one from a policy record.

Request-level (a batch runs until its longest member ends; finished rows stay as zombies; slot KV only):
  static, dynamic, bucketed.  Iteration-level (places refilled every step; slot or paged KV): naive, continuous,
  mixed, chunked.
"""
import math

from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler

PAD = "<pad>"  # rid of the padding chunk: no request owns it, so update() skips it


class Continuous(Scheduler):
    """Prefill-first: admit while there is room; a step is the newcomers' whole prompts, or one decode for all (with
    their drafts where speculating)."""

    def _admit_waiting(self, now: float) -> list[Request]:
        new = []
        while self.waiting and self._can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            self._admit(req, now)
            new.append(req)
        return new

    def schedule(self, now: float) -> SchedulerOutput:
        new = self._admit_waiting(now)
        prefill = [r for r in self.running if r.in_prompt]
        if prefill:
            return self._output([self._chunk(r, self.max_request_tokens) for r in prefill], new)
        return self._output(self._speculate([self._chunk(r, 1) for r in self.running]), new)


class Naive(Continuous):
    """One request at a time, first come first served: continuous with room for one."""

    def __init__(self, max_running: int, max_request_tokens: int, eos_ids=()):
        super().__init__(1, max_request_tokens, eos_ids)


class Mixed(Continuous):
    """Newcomers' whole prompts and every running decode in the same forward pass."""

    def schedule(self, now: float) -> SchedulerOutput:
        new = self._admit_waiting(now)
        return self._output(self._speculate([self._chunk(r, self.max_request_tokens) for r in self.running]), new)


class Chunked(Continuous):
    """A per-step token budget: decodes first (and their drafts), then prompt chunks; a cut prompt continues next
    step."""

    def __init__(self, max_running: int, max_request_tokens: int, eos_ids=(), *, token_budget: int):
        super().__init__(max_running, max_request_tokens, eos_ids)
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.token_budget = token_budget

    def schedule(self, now: float) -> SchedulerOutput:
        budget = self.token_budget
        chunks = []
        for r in self.running:  # decodes first: a running stream never skips a step
            if not r.in_prompt and budget > 0:
                chunks.append(self._chunk(r, 1))
                budget -= 1
        if self.speculation is not None:  # drafts count against the budget, before every prompt chunk
            chunks = self._speculate(chunks, budget)
            budget -= sum(len(c.draft) for c in chunks)
        new = []
        for r in self.running:  # prompts already started continue in admission order
            if r.in_prompt and budget > 0:
                chunks.append(self._chunk(r, budget))
                budget -= len(chunks[-1].tokens)
        while budget > 0 and self.waiting and self._can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            self._admit(req, now)
            new.append(req)
            chunks.append(self._chunk(req, budget))
            budget -= len(chunks[-1].tokens)
        return self._output(chunks, new)


class Dynamic(Scheduler):
    """Launch a batch when `max_batch` wait or the oldest has waited `max_wait_ms`; run it to its longest end."""

    holds_finished = True

    def __init__(self, max_running: int, max_request_tokens: int, eos_ids=(), *, max_batch: int, max_wait_ms: float,
                 pad_prompts: bool = False):
        self.max_batch = min(max_running, max_batch)
        super().__init__(self.max_batch + int(pad_prompts), max_request_tokens, eos_ids)
        self.max_wait = max_wait_ms / 1000.0  # s; inf = pure static
        self.pad_seat = self.seats.allocate() if pad_prompts else None  # scratch row where pad tokens are computed
        self.batch_sizes: list[int] = []      # launched batch sizes, in order

    def wake_time(self, now: float) -> float | None:
        if self.running or not self.waiting or math.isinf(self.max_wait):
            return None
        return self.waiting[0].arrival + self.max_wait

    def _pick(self) -> list[Request]:
        return [self.waiting.popleft() for _ in range(min(self.max_batch, len(self.waiting)))]

    def schedule(self, now: float) -> SchedulerOutput:
        if self.running:  # the batch is closed: every row decodes, finished rows as zombies
            return self._output([self._zombie(r) if r.finish_reason else self._chunk(r, 1) for r in self.running], [])
        full = len(self.waiting) >= self.max_batch
        due = bool(self.waiting) and now >= self.waiting[0].arrival + self.max_wait  # exactly wake_time()
        if not (full or due):
            return self._output([], [])
        batch = self._pick()
        for r in batch:
            self._admit(r, now)
        self.batch_sizes.append(len(batch))
        chunks = [self._chunk(r, self.max_request_tokens) for r in batch]
        longest = max(len(r.prompt) for r in batch)
        pads = sum(longest - len(r.prompt) for r in batch) if self.pad_seat is not None else 0
        # left-padding's tax: real tokens through every layer, discarded
        for start in range(0, pads, self.max_request_tokens):
            chunks.append(ScheduledChunk(PAD, 0, (0,) * min(self.max_request_tokens, pads - start), sample=False,
                                         prompt=True, seat=self.pad_seat))
        return self._output(chunks, batch, pads)


class Static(Dynamic):
    """Wait for a full batch of `max_batch`, with no deadline (a lone request waits forever)."""

    def __init__(self, max_running: int, max_request_tokens: int, eos_ids=(), *, max_batch: int,
                 pad_prompts: bool = False):
        super().__init__(max_running, max_request_tokens, eos_ids, max_batch=max_batch, max_wait_ms=math.inf,
                         pad_prompts=pad_prompts)


class Bucketed(Dynamic):
    """ORACLE: groups the oldest request with the waiting ones closest to its true output length.

    It cheats: it reads each request's real output length (max_new_tokens under ignore_eos), which a
    real server would have to predict. It shows how much of continuous batching's win length-awareness alone buys.
    """

    def _pick(self) -> list[Request]:
        oldest = self.waiting.popleft()
        length = oldest.params.max_new_tokens
        rest = sorted(self.waiting, key=lambda r: abs(r.params.max_new_tokens - length))[:self.max_batch - 1]
        for r in rest:
            self.waiting.remove(r)
        return [oldest, *rest]


POLICIES = {"naive": Naive, "static": Static, "dynamic": Dynamic, "bucketed": Bucketed,
            "continuous": Continuous, "mixed": Mixed, "chunked": Chunked}


def make_scheduler(policy, max_request_tokens: int, eos_ids=()) -> Scheduler:
    """The scheduler for a policy record (engine.specs.PolicySpec: name, max_running, every knob, checked)."""
    return POLICIES[policy.name](policy.max_running, max_request_tokens, eos_ids, **policy.knobs)
