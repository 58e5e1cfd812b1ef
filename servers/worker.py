"""The engine loop in its own thread: a thread-safe inbox in, token events out to each request's asyncio queue.

The thread sleeps on the inbox when the engine is idle, drains it before every step (adds and aborts), and hands
every event back to the event loop with call_soon_threadsafe. An exception fails every request in flight and
marks the worker down (503 and /health).
"""
import queue
import threading
from abc import ABC, abstractmethod
import traceback

from engine import LLMEngine, SamplingParams
from engine.scheduler import StepEvent


class Worker(ABC):
    """What both workers share: an inbox, a loop run in a thread or in the caller, an error that marks it down."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.inbox: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.num_running = 0
        self.on_step = None                       # callback(step record, events) for metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)

    @abstractmethod
    def _loop(self):
        """Serve the inbox until stop(); set self.error and fail what is in flight on an exception."""

    def start(self):
        """Run the loop in a thread of its own (tests). A server runs it in the main thread (`run`) instead:
        torch's CPU thread pool belongs to the thread that loaded the model, and a step driven from another
        thread measured about twice as slow here."""
        self._thread.start()

    def run(self):
        """Run the loop in the calling thread until stop()."""
        self._thread = threading.current_thread()
        self._loop()

    def stop(self):
        self._stop.set()
        self.inbox.put(("wake",))
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()


class EngineWorker(Worker):
    def __init__(self, engine: LLMEngine, max_waiting: int):
        super().__init__(max_waiting)
        self.engine = engine
        self.streams: dict[str, tuple] = {}       # rid -> (loop, asyncio.Queue), owned by the engine thread
        self.num_waiting = 0                      # snapshot for /metrics, refreshed every step

    @property
    def eos_ids(self) -> frozenset:
        return self.engine.scheduler.eos_ids

    @property
    def num_seats(self) -> int:
        return self.engine.scheduler.seats.num_seats

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt, params)

    def queued(self) -> int:
        return self.num_waiting + self.inbox.qsize()

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, loop, q) -> None:
        self.inbox.put(("add", rid, prompt, params, loop, q))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def _emit(self, event: StepEvent):
        target = self.streams.get(event.rid)
        if target:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, event)
            if event.finish_reason:
                del self.streams[event.rid]

    def _drain(self, block: bool, timeout: float | None):
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
                    self._emit(StepEvent(rid, None, f"error: {exc}"))
            elif item[0] == "abort":
                self.engine.abort(item[1])
                self.streams.pop(item[1], None)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self):
        try:
            stalled = True  # the last step ran nothing: sleep until a request arrives or a batching deadline
            while not self._stop.is_set():
                wake = self.engine.wake_time()
                timeout = 0.5 if wake is None else max(0.0, wake - self.engine.now())
                self._drain(block=stalled, timeout=timeout if stalled else None)
                ran = len(self.engine.steps)
                events = self.engine.step()
                stalled = len(self.engine.steps) == ran
                sched = self.engine.scheduler
                self.num_running, self.num_waiting = len(sched.running), len(sched.waiting)
                if len(self.engine.steps) > ran and self.on_step:
                    self.on_step(self.engine.steps[-1], events)
                del self.engine.steps[:-1]  # keep memory flat on a long-running server
                for e in events:
                    self._emit(e)
        except Exception:
            self.error = traceback.format_exc(limit=3)
            for rid in list(self.streams):
                self._emit(StepEvent(rid, None, "error: the engine failed; see /health"))
