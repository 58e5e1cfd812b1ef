"""The scheduler: who runs each step and how many tokens each. One SchedulerOutput per step.

Policies subclass Scheduler and override `schedule` (see engine/policies.py); the bookkeeping that
every policy shares (queue, seats, appending tokens, finishing, zombie rows) lives here.
"""
import heapq
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...] = ()
    new_ids: tuple[str, ...] = ()        # admitted this step
    finished_ids: tuple[str, ...] = ()   # finished since the last step (aborts included)
    preempted_ids: tuple[str, ...] = ()  # no policy preempts yet: seats are reserved whole at admission
    num_pad_tokens: int = 0              # of which left-padding, computed and discarded (padded batch policies)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # rid -> tokens this step

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
        """Query-key pairs per head of the decode attention as computed: one query per seat of the seats up to the
        highest decoding one, against the longest decoding context (a padded [seats, keys] view of the cache)."""
        dec = [c for c in self.chunks if len(c.tokens) == 1]
        return (max(c.seat for c in dec) + 1) * max(c.start + 1 for c in dec) if dec else 0

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
        self.seat_tokens = seat_tokens                      # tokens per seat
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []              # holding a seat, admission order
        self.requests: dict[str, Request] = {}
        self._finished_since: list[str] = []

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
            if ch.zombie or not ch.sample or req.status is Status.FINISHED:
                continue
            token = sampled[ch.rid]
            req.output.append(token)
            req.token_times.append(now)
            reason = stop_reason(req.params, self.eos_ids, token, len(req.output))
            if reason:
                self._finish(req, reason, now)
            events.append(StepEvent(req.rid, token, reason))
        return events

    # --- helpers for policies --------------------------------------------------------------
    def _admit(self, req: Request, now: float) -> None:
        req.seat = self.seats.allocate()
        req.status = Status.RUNNING
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
        del self.requests[req.rid]

    def _chunk(self, req: Request, limit: int) -> ScheduledChunk:
        tokens = req.next_tokens(limit)
        last = req.num_computed + len(tokens) >= len(req.prompt)  # chunk reaches the end of the prompt
        return ScheduledChunk(req.rid, req.seat, req.num_computed, tuple(tokens), sample=last, prompt=req.in_prompt)

    def _zombie(self, req: Request) -> ScheduledChunk:
        """A finished row's dummy decode: its last token again, at its next position (clamped to the seat)."""
        start = min(req.num_computed, self.seat_tokens - 1)
        return ScheduledChunk(req.rid, req.seat, start, (req.output[-1] if req.output else req.prompt[-1],),
                              sample=True, prompt=False, zombie=True)

    def _output(self, chunks: list[ScheduledChunk], new: list[Request], pads: int = 0) -> SchedulerOutput:
        finished, self._finished_since = tuple(self._finished_since), []
        return SchedulerOutput(tuple(chunks), tuple(r.rid for r in new), finished, (), pads,
                               {c.rid: len(c.tokens) for c in chunks})
