"""The scheduler: who runs each step and how many tokens each, one SchedulerOutput per step. Policies subclass it
(engine/core/policies.py); the bookkeeping they share (queue, admission, appending tokens, finishing) lives here.

On the slot cache each running request holds a seat (a row of the cache). On a paged cache (`use_blocks`) its K/V
live in blocks of an engine.core.kv_blocks.BlockManager (LayerPools where layers' windows differ): admission needs
blocks for the whole sequence (less its prefix-cache hits), and after every step each running request releases the
blocks its windows have left and gets the block its next token lands in; when none is free the newest running
request is preempted (its blocks freed; back to the front of the queue with its output, prefilled again on readmission).
"""
import heapq
from abc import ABC, abstractmethod
from collections import deque

from engine.core.kv_blocks import BlockManager
from engine.core.kv_pools import LayerPools
from engine.core.outputs import KVUsage, RunnerOutput, ScheduledChunk, SchedulerOutput, StepEvent
from engine.core.request import Request, SamplingParams, Status, stop_reason

ZOMBIE = SamplingParams()  # a zombie row's sampling: its token is discarded, so greedy, no penalties, no RNG


class SeatTable:
    """Which seats (rows of the slot cache) are free; lowest first, so used seats stay packed."""

    def __init__(self, num_seats: int):
        self.num_seats = num_seats
        self._free = list(range(num_seats))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        return heapq.heappop(self._free)

    def free(self, seat: int) -> None:
        heapq.heappush(self._free, seat)


class Scheduler(ABC):
    """Base scheduler; subclasses are the policies. `holds_finished` keeps finished rows as zombies."""

    holds_finished = False

    def __init__(self, max_running: int, max_request_tokens: int, eos_ids=()):
        self.max_running = max_running
        self.max_request_tokens = max_request_tokens     # prompt + output of one request
        self.seats: SeatTable | None = SeatTable(max_running)  # the slot cache's rows; None on paged KV
        self.blocks: BlockManager | LayerPools | None = None  # paged KV (use_blocks)
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []                 # admitted, in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0                         # since construction
        self._finished_since: list[str] = []
        self._preempted_since: list[str] = []
        self._queried = 0                                # blocks.queried_tokens at the last plan
        self.speculation = None                          # engine.core.speculation.Speculation (use_speculation)

    def use_blocks(self, blocks: BlockManager | LayerPools) -> None:
        """Keep the K/V of running requests in a paged pool instead of a seat each."""
        if self.holds_finished:
            raise ValueError(f"policy {type(self).__name__.lower()!r} runs on the slot cache only (kv=slot): a "
                             "request-level batch keeps its finished rows; paged KV serves naive, continuous, mixed "
                             "and chunked")
        self.blocks, self.seats = blocks, None

    def use_speculation(self, speculation) -> None:
        """Draft tokens for decode rows and verify them in the step (engine.core.speculation.Speculation)."""
        if self.holds_finished:
            raise ValueError(f"policy {type(self).__name__.lower()!r} cannot speculate: a request-level batch runs "
                             "every row to its longest end; speculative decoding serves continuous, mixed and chunked")
        self.speculation = speculation

    # --- the queue -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, now: float) -> StepEvent | None:
        req = self.requests.get(rid)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            self._close(req, "abort", now)
            del self.requests[rid]
        else:
            self._finish(req, "abort", now)
        return StepEvent(rid, None, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def wake_time(self, now: float) -> float | None:
        """When an idle scheduler may launch without a new arrival (a batching deadline), else None."""
        return None

    # --- one step --------------------------------------------------------------------------
    @abstractmethod
    def schedule(self, now: float) -> SchedulerOutput:
        """The policy: who runs this step and how many tokens each."""

    def update(self, plan: SchedulerOutput, out: RunnerOutput, now: float) -> list[StepEvent]:
        """Append sampled tokens (a drafted row's kept drafts, then its sampled token), finish requests, free their
        places; one event per new token."""
        events = []
        for ch in plan.chunks:
            req = self.requests.get(ch.rid)
            if req is None:  # its batch ended earlier in this update
                continue
            kept = out.accepted.get(ch.rid, ()) if ch.draft else ()
            req.num_computed += len(ch.tokens) - len(ch.draft) + len(kept)  # rejected drafts' K/V: rolled back
            if ch.draft:
                self.speculation.observe(req.rid, len(ch.draft), len(kept))
            if self.blocks is not None:  # kept drafts join the output below: they register and slide next step
                self.blocks.cache(req.rid, req.num_computed - len(kept), req.tokens)
                self.blocks.slide(req.rid, req.num_computed - len(kept))
            if ch.zombie or not ch.sample or req.status is Status.FINISHED:
                continue
            lps = out.accepted_logprobs.get(ch.rid) if kept else None
            for i, token in enumerate(kept):
                if self._append(req, token, *(lps[i] if lps else (None, None)), now, events):
                    break
            else:
                self._append(req, out.tokens[ch.rid], *out.logprobs.get(ch.rid, (None, None)), now, events)
            if ch.draft and self.blocks is not None and req.status is Status.RUNNING:
                self.blocks.shrink(req.rid, req.num_tokens)  # blocks held for rejected drafts: freed
        if self.blocks is not None:
            self._grow()
        return events

    def _append(self, req: Request, token: int, lp, top, now: float, events: list[StepEvent]) -> bool:
        """A new output token and its event; True when it ends the request."""
        req.output.append(token)
        req.token_times.append(now)
        reason = stop_reason(req.params, self.eos_ids, token, len(req.output))
        if reason:
            self._finish(req, reason, now)
        events.append(StepEvent(req.rid, token, reason, lp, top, cached_tokens=req.num_cached))
        return reason is not None

    def _grow(self) -> None:
        """Paged KV: every running request, oldest first, gets blocks for all its tokens (the next one's
        included); when none is free the newest running request is preempted, possibly the one in need."""
        for req in list(self.running):
            while req.status is Status.RUNNING and not self.blocks.grow(req.rid, req.num_tokens):
                self._preempt(self.running[-1])

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.rid)
        req.status, req.num_computed, req.replayed = Status.WAITING, 0, len(req.output)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._preempted_since.append(req.rid)

    # --- helpers for policies --------------------------------------------------------------
    def _can_admit(self, req: Request) -> bool:
        """A free seat (slot cache), or room below max_running and blocks above the watermark (paged)."""
        if self.blocks is None:
            return self.seats.can_allocate()
        return len(self.running) < self.max_running and self.blocks.can_allocate(req.num_tokens, req.tokens)

    def _admit(self, req: Request, now: float) -> None:
        if self.blocks is None:
            req.seat = self.seats.allocate()
        else:
            req.num_cached = req.num_computed = self.blocks.allocate(req.rid, req.num_tokens, req.tokens)
        req.status = Status.RUNNING
        if req.admit_time is None:
            req.admit_time = now
        self.running.append(req)

    def _close(self, req: Request, reason: str, now: float) -> None:
        req.status, req.finish_reason, req.finish_time = Status.FINISHED, reason, now
        self._finished_since.append(req.rid)
        if self.speculation is not None:
            self.speculation.forget(req.rid)

    def _finish(self, req: Request, reason: str, now: float) -> None:
        """Close a running request; free its place now, or with its whole batch when rows are held."""
        self._close(req, reason, now)
        if not self.holds_finished:
            self._release(req)
        elif all(r.status is Status.FINISHED for r in self.running):  # the batch's longest just ended
            for r in list(self.running):
                self._release(r)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        if self.blocks is None:
            self.seats.free(req.seat)
        else:
            self.blocks.free(req.rid)
        del self.requests[req.rid]

    def _chunk(self, req: Request, limit: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        tokens = req.next_tokens(limit)
        last = req.num_computed + len(tokens) >= req.prefill_len  # the chunk reaches the end of the prefill
        tables = self.blocks.tables(req.rid) if isinstance(self.blocks, LayerPools) else None  # one copy each
        table = () if self.blocks is None else tables[self.blocks.main] if tables else tuple(self.blocks.table(req.rid))
        return ScheduledChunk(req.rid, req.num_computed, tuple(tokens) + draft, sample=last, prompt=req.in_prompt,
                              seat=req.seat, blocks=table, tables=tables, params=req.params if last else None,
                              history=(req.prompt, req.output) if last and req.params.penalized else None,
                              draft=draft)

    def _speculate(self, chunks: list[ScheduledChunk], budget: int | None = None) -> list[ScheduledChunk]:
        """The step's decode rows with their drafts (engine.core.speculation), at most `budget` drafted tokens in all
        (None: no limit); on a paged cache each draft cut to the blocks it can take from the free ones."""
        if self.speculation is None:
            return chunks
        drafts = self.speculation.drafts(chunks, self.requests, budget)
        for i, c in enumerate(chunks):
            draft = drafts.get(c.rid)
            if draft and self.blocks is not None:
                req = self.requests[c.rid]
                while draft and not self.blocks.grow(req.rid, req.num_tokens + len(draft)):
                    draft = draft[:-1]
            if draft:
                chunks[i] = self._chunk(self.requests[c.rid], 1, draft)
        return chunks

    def _zombie(self, req: Request) -> ScheduledChunk:
        """A finished row's dummy decode: its last token again, at its next position (clamped to the seat)."""
        start = min(req.num_computed, self.max_request_tokens - 1)
        return ScheduledChunk(req.rid, start, (req.output[-1] if req.output else req.prompt[-1],), sample=True,
                              zombie=True, seat=req.seat, params=ZOMBIE)

    def _output(self, chunks: list[ScheduledChunk], new: list[Request], pads: int = 0) -> SchedulerOutput:
        finished, preempted = (), ()
        if chunks:  # a plan with no chunks does not run: its ids wait for the next one that does
            finished, self._finished_since = tuple(self._finished_since), []
            preempted, self._preempted_since = tuple(self._preempted_since), []
        return SchedulerOutput(tuple(chunks), tuple(r.rid for r in new), finished, preempted, pads,
                               {r.rid: r.num_cached for r in new}, self._usage(chunks))

    def _usage(self, chunks: list[ScheduledChunk]) -> KVUsage:
        scheduled = {c.rid: len(c.tokens) for c in chunks}
        held = sum(r.num_computed + scheduled.get(r.rid, 0) for r in self.running)
        if self.blocks is None:
            return KVUsage(len(self.running), held, len(self.running) * self.max_request_tokens)
        pool, queried = self.blocks, self.blocks.queried_tokens - self._queried
        self._queried = pool.queried_tokens
        return KVUsage(len(self.running), held, pool.num_used * pool.block_size, pool.num_used, pool.num_free,
                       queried)
