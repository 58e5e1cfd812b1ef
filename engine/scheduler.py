"""The scheduler: who runs each step and how many tokens each. One SchedulerOutput per step.

Policies subclass Scheduler and override `schedule` (see engine/policies.py); the bookkeeping that
every policy shares (queue, seats, appending tokens, finishing, zombie rows) lives here.

On a paged KV cache (`use_blocks`) a seat is only a place among the running requests (max_seats caps them);
their K/V live in blocks of an engine.blocks.BlockManager. Admission also needs blocks for the whole sequence
(less its prefix-cache hits), and after every step each running request gets the block its next token lands in.
When none is free, the newest running request is preempted: its blocks are freed, it returns to the front of the
queue with the tokens it produced, and on readmission prefills prompt + output (recompute) and continues.
"""
import heapq
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from engine.blocks import BlockManager
from engine.request import Request, Status, stop_reason


@dataclass(frozen=True)
class ScheduledChunk:
    rid: str
    seat: int
    start: int                  # position of the first token in the sequence
    tokens: tuple[int, ...]     # a whole prompt, a prompt chunk or one decode token
    sample: bool                # take a token from the chunk's last position
    prompt: bool = False        # the tokens are (part of) the prompt
    zombie: bool = False        # a finished row kept in a static batch: computed, then discarded
    blocks: tuple[int, ...] = ()  # paged KV: the request's block table (its positions in order)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...] = ()
    new_ids: tuple[str, ...] = ()        # admitted this step
    finished_ids: tuple[str, ...] = ()   # finished since the last step (aborts included)
    preempted_ids: tuple[str, ...] = ()  # preempted since the last step (paged KV out of blocks)
    num_pad_tokens: int = 0              # of which left-padding, computed and discarded (padded batch policies)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # rid -> tokens this step
    num_cached_tokens: dict[str, int] = field(default_factory=dict)     # rid in new_ids -> prefix-cache hit tokens

    @property
    def total_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)  # padding chunks included

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens fed this step (whole prompts, chunks and padding)."""
        return sum(len(c.tokens) for c in self.chunks if c.prompt)

    @property
    def num_decode_rows(self) -> int:
        """One-token decode rows this step (zombie rows included: they are computed)."""
        return sum(1 for c in self.chunks if not c.prompt)

    @property
    def num_sampled_rows(self) -> int:
        """Rows that produce a token (zombies included): the rows the LM head and the sampler see."""
        return sum(1 for c in self.chunks if c.sample)

    @property
    def num_useful_rows(self) -> int:
        """Rows whose token is kept."""
        return sum(1 for c in self.chunks if c.sample and not c.zombie)

    @property
    def decode_attention(self) -> int:
        """Query-key pairs per head of the decode attention as computed, against the longest decoding context: on
        slots one query per seat up to the highest decoding one (a padded [seats, keys] view of the cache), on a
        paged pool one per decode (its keys gathered through its block table, padded to the longest)."""
        dec = [c for c in self.chunks if len(c.tokens) == 1]
        if not dec:
            return 0
        rows = len(dec) if dec[0].blocks else max(c.seat for c in dec) + 1
        return rows * max(c.start + 1 for c in dec)

    @property
    def prompt_attention(self) -> int:
        """Query-key pairs per head of the prompt attention as computed: every multi-token chunk padded to the
        longest chunk, against keys up to the furthest chunk end."""
        pre = [c for c in self.chunks if len(c.tokens) > 1]
        if not pre:
            return 0
        return len(pre) * max(len(c.tokens) for c in pre) * max(c.start + len(c.tokens) for c in pre)

    @property
    def multi_row(self) -> int:
        """1 when more than one row goes through the layers (matrix-matrix products), 0 for a single row (the
        matrix-vector path, a different kernel with its own cost)."""
        return int(self.total_tokens > 1)

    @property
    def is_mixed(self) -> int:
        """1 when prompt tokens and decodes share the pass (the attention splits in two parts), else 0."""
        return int(self.kind == "mixed")

    def features(self) -> dict[str, int]:
        """The step's cost features (engine.simulator.FEATURES), the same for the engine's records and the
        simulator's clock."""
        return {"num_prompt_tokens": self.num_prompt_tokens, "num_decode_rows": self.num_decode_rows,
                "num_sampled_rows": self.num_sampled_rows, "decode_attention": self.decode_attention,
                "prompt_attention": self.prompt_attention, "is_mixed": self.is_mixed, "multi_row": self.multi_row}

    @property
    def kind(self) -> str:
        """"idle", "prefill", "decode" or "mixed" (prompt tokens and decodes in one pass)."""
        if not self.chunks:
            return "idle"
        prompt = any(c.prompt for c in self.chunks)
        decode = any(not c.prompt for c in self.chunks)
        return "mixed" if prompt and decode else ("prefill" if prompt else "decode")


@dataclass(frozen=True)
class StepEvent:
    rid: str
    token: int | None           # None for an abort or error
    finish_reason: str | None   # set on the request's last event
    logprob: float | None = None                            # the token's log-probability, if asked
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token id, log-probability), most likely first


class SeatTable:
    """Which seats (rows of the KV cache) are free; lowest first, so used seats stay packed."""

    def __init__(self, num_seats: int):
        self.num_seats = num_seats
        self._free = list(range(num_seats))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        return heapq.heappop(self._free)

    def free(self, seat: int) -> None:
        heapq.heappush(self._free, seat)


class Scheduler(ABC):
    """Base scheduler; subclasses are the policies. `holds_finished` keeps finished rows as zombies."""

    holds_finished = False

    def __init__(self, num_seats: int, seat_tokens: int, eos_ids=()):
        self.seats = SeatTable(num_seats)
        self.seat_tokens = seat_tokens                      # tokens per seat (per request on paged KV)
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []              # holding a seat, admission order
        self.requests: dict[str, Request] = {}
        self.blocks: BlockManager | None = None       # paged KV (use_blocks); None: each seat holds its own rows
        self.num_preemptions = 0                      # since construction
        self._finished_since: list[str] = []
        self._preempted_since: list[str] = []

    def use_blocks(self, blocks: BlockManager) -> None:
        """Keep the K/V of running requests in a paged pool instead of a row per seat."""
        if self.holds_finished:
            raise ValueError(f"policy {type(self).__name__.lower()!r} runs on the slot cache only (kv=slot): a "
                             "request-level batch keeps its finished rows; paged KV serves naive, continuous, mixed "
                             "and chunked")
        self.blocks = blocks

    # --- the queue -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, now: float, reason: str = "abort") -> StepEvent | None:
        req = self.requests.get(rid)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            self._close(req, reason, now)
            del self.requests[rid]
        else:
            self._finish(req, reason, now)
        return StepEvent(rid, None, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def wake_time(self, now: float) -> float | None:
        """When an idle scheduler may launch without a new arrival (a batching deadline), else None."""
        return None

    # --- one step --------------------------------------------------------------------------
    @abstractmethod
    def schedule(self, now: float) -> SchedulerOutput:
        """The policy: who runs this step and how many tokens each."""

    def update(self, plan: SchedulerOutput, sampled: dict[str, int], now: float) -> list[StepEvent]:
        """Append sampled tokens, finish requests, free seats; return one event per new token."""
        events = []
        for ch in plan.chunks:
            req = self.requests.get(ch.rid)
            if req is None:  # its batch ended earlier in this update
                continue
            req.num_computed += len(ch.tokens)
            if self.blocks is not None:
                self.blocks.cache(req.rid, req.num_computed, req.tokens)
            if ch.zombie or not ch.sample or req.status is Status.FINISHED:
                continue
            token = sampled[ch.rid]
            req.output.append(token)
            req.token_times.append(now)
            reason = stop_reason(req.params, self.eos_ids, token, len(req.output))
            if reason:
                self._finish(req, reason, now)
            events.append(StepEvent(req.rid, token, reason))
        if self.blocks is not None:
            self._grow()
        return events

    def _grow(self) -> None:
        """Paged KV: every running request, oldest first, gets blocks for all its tokens (the next one's
        included); when none is free the newest running request is preempted, possibly the one in need."""
        for req in list(self.running):
            while req.status is Status.RUNNING and not self.blocks.grow(req.rid, req.num_tokens):
                self._preempt(self.running[-1])

    def _preempt(self, req: Request) -> None:
        """Free a running request's seat and blocks; it waits at the front of the queue keeping its output, to be
        prefilled again (prompt + output) on readmission."""
        self.running.remove(req)
        self.seats.free(req.seat)
        self.blocks.free(req.rid)
        req.status, req.seat, req.num_computed, req.replayed = Status.WAITING, None, 0, len(req.output)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._preempted_since.append(req.rid)

    # --- helpers for policies --------------------------------------------------------------
    def _can_admit(self, req: Request) -> bool:
        """A free seat and, on paged KV, room for the request's sequence above the watermark."""
        return self.seats.can_allocate() and (self.blocks is None or
                                              self.blocks.can_allocate(req.num_tokens, req.tokens))

    def _admit(self, req: Request, now: float) -> None:
        req.seat = self.seats.allocate()
        if self.blocks is not None:
            req.num_cached = req.num_computed = self.blocks.allocate(req.rid, req.num_tokens, req.tokens)
        req.status = Status.RUNNING
        if req.admit_time is None:
            req.admit_time = now
        self.running.append(req)

    def _close(self, req: Request, reason: str, now: float) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self._finished_since.append(req.rid)

    def _finish(self, req: Request, reason: str, now: float) -> None:
        """Close a running request; free its seat now, or with its whole batch when rows are held."""
        self._close(req, reason, now)
        if not self.holds_finished:
            self._release(req)
        elif all(r.status is Status.FINISHED for r in self.running):  # the batch's longest just ended
            for r in list(self.running):
                self._release(r)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.seats.free(req.seat)
        if self.blocks is not None:
            self.blocks.free(req.rid)
        del self.requests[req.rid]

    def _chunk(self, req: Request, limit: int) -> ScheduledChunk:
        tokens = req.next_tokens(limit)
        last = req.num_computed + len(tokens) >= req.prefill_len  # chunk reaches the end of the prefill
        table = tuple(self.blocks.table(req.rid)) if self.blocks is not None else ()
        return ScheduledChunk(req.rid, req.seat, req.num_computed, tuple(tokens), sample=last, prompt=req.in_prompt,
                              blocks=table)

    def _zombie(self, req: Request) -> ScheduledChunk:
        """A finished row's dummy decode: its last token again, at its next position (clamped to the seat)."""
        start = min(req.num_computed, self.seat_tokens - 1)
        return ScheduledChunk(req.rid, req.seat, start, (req.output[-1] if req.output else req.prompt[-1],),
                              sample=True, prompt=False, zombie=True)

    def _output(self, chunks: list[ScheduledChunk], new: list[Request], pads: int = 0) -> SchedulerOutput:
        finished, self._finished_since = tuple(self._finished_since), []
        preempted, self._preempted_since = tuple(self._preempted_since), []
        return SchedulerOutput(tuple(chunks), tuple(r.rid for r in new), finished, preempted, pads,
                               {c.rid: len(c.tokens) for c in chunks}, {r.rid: r.num_cached for r in new})
