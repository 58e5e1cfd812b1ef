"""Hugging Face `generate` behind the same worker interface as the engine: the naive server (one request at a
time) and the batcher (a collector forms a batch of up to `max_batch` requests, waiting at most `max_wait_ms` after
the first, then one left-padded batch generate streams every row).

A batch is closed once it starts: newcomers wait for the whole batch, finished rows keep computing until the
longest ends, and an infinite wait is pure static batching (a lone request waits for company forever).
One sampling setting per batch (the first request's): batch generate has no per-row temperature, seed, penalties
or logprobs; the app refuses penalties and logprobs on these backends (400, see NO_PER_ROW).
A failure inside generate ends every request of the batch and of the queue with an error event and marks the
worker down.
"""
import math
import queue
import time
import traceback
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from engine import SamplingParams, StepEvent
from engine.core.request import check_request, stop_reason
from engine.model.hf import generate_padded
from servers.worker import SHUTDOWN, Worker, hand_off

BACKEND_DOWN = "the generate backend failed; see /health"

NO_PER_ROW = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")  # SamplingParams fields


@dataclass
class Job:
    rid: str
    prompt: list[int]
    params: SamplingParams
    loop: object
    q: object
    count: int = 0
    done: bool = False
    times: list = field(default_factory=list)


class BatchStreamer(BaseStreamer):
    """Receives each generate step's new token per row (on generate's thread) and hands them to the jobs."""

    def __init__(self, worker: "GenerateWorker", jobs: list[Job]):
        self.worker, self.jobs, self.prompt_seen = worker, jobs, False
        self.last: float | None = None  # time.perf_counter() of the previous step's tokens

    def put(self, value):
        if not self.prompt_seen:  # the first call carries the prompt ids
            self.prompt_seen = True
            return
        now = time.perf_counter()
        if self.last is not None:
            self.worker.measure_step("decode", now - self.last, 0)
        self.last = now
        if self.worker.overdue():
            self.worker.fail(self.jobs, "shutdown", SHUTDOWN)
            return
        tokens = value.view(-1).tolist()
        live, items = 0, []
        for job, token in zip(self.jobs, tokens):
            if job.done:
                continue  # a finished row: computed by generate, discarded here (a zombie row)
            live += 1
            job.count += 1
            reason = stop_reason(job.params, self.worker.eos_ids, token, job.count)
            if job.rid in self.worker.aborted:
                job.done, reason = True, None
                continue
            job.done = reason is not None
            items.append((job.loop, job.q, StepEvent(job.rid, token, reason)))
        hand_off(items)
        self.worker.metrics_step(len(tokens), live)

    def end(self):
        for job in self.jobs:  # generate stopped (every row hit EOS or the batch's longest): close what is open
            if not job.done:
                job.done = True
                if job.rid not in self.worker.aborted:
                    job.loop.call_soon_threadsafe(job.q.put_nowait, StepEvent(job.rid, None, "length"))


class NoEos(LogitsProcessor):
    """End-of-sequence ids never chosen in the rows whose request asked for ignore_eos (the others may end)."""

    def __init__(self, jobs: list[Job], eos_ids: list[int]):
        self.rows = [i for i, j in enumerate(jobs) if j.params.ignore_eos]
        self.eos_ids = eos_ids

    def __call__(self, input_ids, scores):
        if self.rows and self.eos_ids:
            rows = torch.tensor(self.rows, device=scores.device)[:, None]
            scores[rows, torch.tensor(self.eos_ids, device=scores.device)[None, :]] = -torch.inf
        return scores


class RowsDone(StoppingCriteria):
    """A row is done when its own request finished or its client left; generate ends when every row is done."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([j.done for j in self.jobs], device=input_ids.device)


class GenerateWorker(Worker):
    def __init__(self, model, eos_ids, max_request_tokens: int, max_batch: int, max_wait_ms: float, max_waiting: int,
                 pad_id: int):
        super().__init__(max_waiting)
        self.model, self.eos_ids, self.max_request_tokens = model, set(eos_ids), max_request_tokens
        self.vocab_size = model.config.vocab_size
        self.max_batch, self.max_wait, self.pad_id = max_batch, max_wait_ms / 1000.0, pad_id
        self.max_running = max_batch
        self.aborted: set[str] = set()
        self.waiting: dict[str, Job] = {}   # rid -> job submitted and not yet in a batch (nor aborted)
        self.batch: list[Job] = []          # the batch generate is running

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """The engine's request checks, on this worker's vocabulary and max_request_tokens."""
        check_request(prompt, params, self.vocab_size, self.max_request_tokens)

    def metrics_step(self, rows: int, live: int) -> None:
        """One generate step of `rows` rows, `live` of them kept, to the metrics (`on_step`)."""
        if self.on_step:
            self.on_step(rows, 0, live, self.num_running, self.num_waiting, self.num_running / self.max_running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def queued(self) -> int:
        return len(self.waiting)

    def submit(self, rid, prompt, params, loop, q):
        job = Job(rid, prompt, params, loop, q)
        self.waiting[rid] = job
        self.inbox.put(job)
        if self.error is not None:  # the loop has died: no one will answer from the inbox
            self.fail([job], "error", BACKEND_DOWN)

    def abort(self, rid: str):
        self.aborted.add(rid)
        self.waiting.pop(rid, None)

    def wait_estimate(self, prompt_len: int, max_tokens: int) -> float:
        """The running batch's longest row left, then each batch of up to max_batch queued requests runs to its
        longest max_tokens; a step costs the measured s per generate step. 0 until a step was measured."""
        if self.decode_s is None:
            return 0.0
        now = [j.params.max_new_tokens - j.count for j in self.batch if not j.done]
        queued = [j.params.max_new_tokens for j in list(self.waiting.values())]
        steps = max(now, default=0) + sum(max(queued[i:i + self.max_batch])
                                          for i in range(0, len(queued), self.max_batch))
        return steps * self.decode_s

    def fail(self, jobs: list[Job], finish: str, message: str) -> None:
        """End every open job in `jobs` with a `finish` ("error", "shutdown") event."""
        for job in jobs:
            if not job.done and job.rid not in self.aborted:
                job.loop.call_soon_threadsafe(job.q.put_nowait, StepEvent(job.rid, None, finish, error=message))
            job.done = True
            self.waiting.pop(job.rid, None)

    def _collect(self) -> list[Job]:
        """Block for a first job, then take more until the batch is full or the window after the first closes."""
        try:
            batch = [self.inbox.get(timeout=0.5)]
        except queue.Empty:
            return []
        if not isinstance(batch[0], Job):  # stop()'s or drain()'s wake-up
            return []
        self.waiting.pop(batch[0].rid, None)
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch and not (self._stop.is_set() or self.draining):  # a drain runs what it has
            left = deadline - time.monotonic()
            if left <= 0 and not math.isinf(self.max_wait):
                break
            try:
                job = self.inbox.get(timeout=0.5 if math.isinf(self.max_wait) else left)
            except queue.Empty:
                continue
            if isinstance(job, Job):
                batch.append(job)
                self.waiting.pop(job.rid, None)
        return [j for j in batch if j.rid not in self.aborted]

    def _generate(self, batch: list[Job]):
        first = batch[0].params
        new = max(j.params.max_new_tokens for j in batch)
        sampling = {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p,
                    "top_k": first.top_k or None} if first.temperature > 0 else {"do_sample": False}
        if first.seed is not None:
            torch.manual_seed(first.seed)
        self.num_running, self.batch = len(batch), batch
        generate_padded(self.model, [j.prompt for j in batch], new, self.pad_id, min_new_tokens=0,
                        streamer=BatchStreamer(self, batch), stopping_criteria=StoppingCriteriaList([RowsDone(batch)]),
                        logits_processor=LogitsProcessorList([NoEos(batch, sorted(self.eos_ids))]), **sampling)
        self.num_running = 0

    def _queued_jobs(self) -> list[Job]:
        """Take every job still in the inbox."""
        jobs = []
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return jobs
            if isinstance(item, Job):
                jobs.append(item)

    def _loop(self):
        try:
            while not self._stop.is_set():
                if self.draining and (self.overdue() or not self.waiting):
                    self.fail(self._queued_jobs(), "shutdown", SHUTDOWN)
                    break
                batch = self._collect()
                if batch:
                    self._generate(batch)
                    self.aborted -= {j.rid for j in batch}
                    self.batch = []
        except Exception:
            self.error = traceback.format_exc(limit=3)
            self.fail(self.batch + self._queued_jobs(), "error", BACKEND_DOWN)
            self.num_running = 0
