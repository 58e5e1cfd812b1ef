"""The engine loop in its own thread: a thread-safe inbox in, token events out to each request's asyncio queue.

The thread sleeps on the inbox when the engine is idle, empties it before every step (adds and aborts), and hands
each step's events to the event loop in one call_soon_threadsafe. An exception fails every request in flight and
marks the worker down (503 and /health). drain(grace_s) stops the loop once what is in flight has finished, or
at the grace deadline, failing what is left with a "shutdown" event.

With compiled steps, the loop first warms the engine up (LLMEngine.warm_up: every compiled step shape, compiled
before the first request pays for it); `warming` is true until then.

Admission by time: the worker measures its step costs (exponential moving averages) and estimates, for a new
request, the wait to its first token from the work ahead of it (see wait_estimate).
"""
import heapq
import queue
import threading
import time
import traceback
from abc import ABC, abstractmethod

from engine import LLMEngine, SamplingParams, StepEvent

EMA = 0.2                                          # weight of the newest measurement in the moving averages
SHUTDOWN = "the server is shutting down and this request did not finish within the grace period"
ENGINE_DOWN = "the engine failed; see /health"


def hand_off(items: list[tuple]) -> None:
    """Give a step's (event loop, asyncio queue, event) triples to their loops: one call into each loop per step,
    not one per token."""
    batches: dict = {}  # loop -> [(queue, event)]
    for loop, q, e in items:
        batches.setdefault(loop, []).append((q, e))
    for loop, batch in batches.items():
        loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple]) -> None:
    """In the event loop: put each (queue, event)."""
    for q, e in batch:
        q.put_nowait(e)


class Worker(ABC):
    """What both workers share: an inbox, a loop run in a thread or in the caller, an error that marks it down,
    a drain deadline, the step-cost averages."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.inbox: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.warming = False                      # compiling the engine's steps before serving (/health: 503)
        self.warm_up_s = 0.0                      # seconds the warm-up took (LLMEngine.warm_up)
        self.num_running = 0
        self.on_step = None                       # ServerMetrics.on_step, called after each forward pass
        self.on_speculation = None                # ServerMetrics.on_speculation, after each step that may draft
        self.drain_deadline: float | None = None  # time.monotonic() s at which a drain fails what is left
        self.decode_s: float | None = None        # s per decode step (moving average)
        self.prefill_s: float = 0.0               # s per prompt token (moving average)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)

    @abstractmethod
    def _loop(self):
        """Serve the inbox until stop(); set self.error and fail what is in flight on an exception."""

    @abstractmethod
    def wait_estimate(self, prompt_len: int, max_tokens: int) -> float:
        """Estimated seconds from now to a new request's first token, from the work ahead of it."""

    def start(self):
        """Run the loop in a thread of its own (tests). A server runs it in the main thread (`run`) instead, where
        torch's CPU thread pool lives (the thread that loaded the model)."""
        self._thread.start()

    def run(self):
        """Run the loop in the calling thread until stop() or the end of a drain."""
        self._thread = threading.current_thread()
        self._loop()

    def stop(self):
        self._stop.set()
        self.inbox.put(("wake",))
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=10)

    def drain(self, grace_s: float) -> None:
        """Admit nothing more; let what is in flight finish for up to grace_s seconds, then fail it and stop.
        Safe from a signal handler: sets a deadline and wakes the loop."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + grace_s
            self.inbox.put(("wake",))

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def overdue(self) -> bool:
        """Draining, and past the grace deadline."""
        return self.draining and time.monotonic() >= self.drain_deadline

    def measure_step(self, kind: str, duration: float, prompt_tokens: int) -> None:
        """Fold one step into the averages: decode steps give s/step (the fixed cost of any step); prefill and mixed
        steps give s/prompt token net of that fixed cost, so many prompts in one step are not charged it per token."""
        if kind == "decode":
            self.decode_s = duration if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * duration
        elif prompt_tokens and self.decode_s is not None:
            spent = max(0.0, duration - self.decode_s) / prompt_tokens
            self.prefill_s = spent if not self.prefill_s else (1 - EMA) * self.prefill_s + EMA * spent

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()


class EngineWorker(Worker):
    def __init__(self, engine: LLMEngine, max_waiting: int):
        super().__init__(max_waiting)
        self.engine = engine
        self.warming = engine.compiled  # until _loop's warm-up is done
        self.streams: dict[str, tuple] = {}       # rid -> (loop, asyncio.Queue), owned by the engine thread
        self.num_waiting = 0                      # snapshot for /metrics, refreshed every step
        self.pending: dict[str, tuple[int, int]] = {}  # rid -> (prompt tokens, max tokens), submitted, not yet queued
        self.ahead: tuple[list[int], list[tuple[int, int]]] = ([], [])  # tokens left per running request;
        # (prompt tokens, max tokens) per queued one; replaced whole by the engine thread after every step
        self._spec_seen = None                    # the speculation counters at the last step (metrics take deltas)

    @property
    def eos_ids(self) -> frozenset:
        return self.engine.scheduler.eos_ids

    @property
    def max_running(self) -> int:
        return self.engine.scheduler.max_running

    @property
    def max_request_tokens(self) -> int:
        return self.engine.scheduler.max_request_tokens

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt, params)

    def queued(self) -> int:
        return self.num_waiting + len(self.pending)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, loop, q) -> None:
        self.pending[rid] = (len(prompt), params.max_new_tokens)
        self.inbox.put(("add", rid, prompt, params, loop, q))
        if self.error is not None:  # the loop has died: no one will answer from the inbox
            loop.call_soon_threadsafe(q.put_nowait, StepEvent(rid, None, "error", error=ENGINE_DOWN))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def wait_estimate(self, prompt_len: int, max_tokens: int) -> float:
        """Places free up as running requests finish (at most their tokens left, in decode steps); each queued
        request takes the first place to free for its max_tokens; the new request gets the next one. Requests whose
        places free at the same step are prefilled in one step: each such step costs a decode step plus the measured
        cost per prompt token. 0 until a decode step was measured."""
        if self.decode_s is None:
            return 0.0
        running, waiting = self.ahead
        waiting = waiting + list(self.pending.values())
        free = [0] * max(0, self.max_running - len(running)) + list(running)
        heapq.heapify(free)
        starts = set()  # decode steps from now at which queued requests are admitted (one prefill step each)
        for _, m in waiting:
            start = heapq.heappop(free)
            starts.add(start)
            heapq.heappush(free, start + m)
        steps = free[0] + len(starts | {free[0]})
        return steps * self.decode_s + (prompt_len + sum(p for p, _ in waiting)) * self.prefill_s

    def _count(self, rec, generated: int) -> None:
        """A step's record and its `generated` tokens to the metrics (on_step; on_speculation where drafting)."""
        if self.on_step is None:
            return
        paged = rec.blocks_used is not None
        usage = rec.blocks_used / (rec.blocks_used + rec.blocks_free) if paged else self.num_running / self.max_running
        self.on_step(rec.num_tokens, rec.num_prompt_tokens, generated, self.num_running, self.num_waiting, usage,
                     (rec.queried_tokens, rec.cached_tokens, rec.preempted) if paged else None)
        spec = self.engine.scheduler.speculation
        if spec is not None and self.on_speculation is not None:
            now = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted, list(spec.accepted_per_pos))
            last = self._spec_seen or (0, 0, 0, [0] * len(now[3]))
            self.on_speculation(*(a - b for a, b in zip(now[:3], last[:3])), [a - b for a, b in zip(now[3], last[3])])
            self._spec_seen = now

    def _emit(self, events: list[StepEvent]):
        """Hand events to the streams still open; a finished request's stream closes."""
        items = []
        for e in events:
            target = self.streams.get(e.rid)
            if target:
                items.append((*target, e))
                if e.finish_reason:
                    del self.streams[e.rid]
        hand_off(items)

    def _take_inbox(self, block: bool, timeout: float | None):
        """Apply the inbox's adds and aborts (waiting for the first up to `timeout` s if `block`)."""
        try:
            item = self.inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return
        while True:
            if item[0] == "add":
                _, rid, prompt, params, loop, q = item
                self.streams[rid] = (loop, q)
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as exc:  # validated already; anything left is reported to that request only
                    self._emit([StepEvent(rid, None, "error", error=str(exc))])
                self.num_waiting = len(self.engine.scheduler.waiting)  # counted there before it leaves pending
                self.pending.pop(rid, None)
            elif item[0] == "abort":
                self.engine.abort(item[1])
                self.streams.pop(item[1], None)
                self.pending.pop(item[1], None)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, finish: str, message: str) -> None:
        """End every request in flight or still in the inbox with a `finish` ("error", "shutdown") event; abort
        them."""
        self._take_inbox(block=False, timeout=None)
        rids = list(self.streams)
        self._emit([StepEvent(rid, None, finish, error=message) for rid in rids])
        if self.error is None:
            for rid in rids:
                self.engine.abort(rid)

    def _loop(self):
        try:
            self.warm_up_s = self.engine.warm_up()
            self.warming = False
            stalled = True  # the last step ran nothing: sleep until a request arrives or a batching deadline
            while not self._stop.is_set():
                if self.draining and (self.overdue() or not (self.streams or self.pending)):
                    self._fail_all("shutdown", SHUTDOWN)
                    break
                wake = self.engine.wake_time()
                timeout = 0.5 if wake is None else max(0.0, wake - self.engine.now())
                self._take_inbox(block=stalled, timeout=timeout if stalled else None)
                events = self.engine.step()
                records = self.engine.take_records()
                stalled = not records
                sched = self.engine.scheduler
                self.num_running, self.num_waiting = len(sched.running), len(sched.waiting)
                self.ahead = ([r.params.max_new_tokens - len(r.output) for r in sched.running],
                              [(len(r.prompt), r.params.max_new_tokens) for r in sched.waiting])
                for rec in records:  # one per step
                    self.measure_step(rec.kind, rec.duration, rec.num_prompt_tokens)
                    self._count(rec, sum(1 for e in events if e.token is not None))
                self._emit(events)
        except Exception:
            self.error = traceback.format_exc(limit=3)
            self._fail_all("error", ENGINE_DOWN)
