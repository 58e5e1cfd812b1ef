"""Intra-op threads that follow the free cores: a 2-thread step beside a busy process on one of 2 cores stalls at
every parallel region's barrier (one thread waits for the other's turn on its core), so a lost core costs far more
than its share. Every INTERVAL s the governor measures the CPU other processes used and runs the steps on the cores
left (at least one, at most the configured threads)."""
import os
import time

import torch

from engine.machine import machine_cpu_s, process_cpu_s

INTERVAL = 0.5      # s between two looks at the machine
BUSY = 0.6          # CPUs of other processes' work that take a core away


class ThreadGovernor:
    def __init__(self, max_threads: int):
        self.max_threads = max_threads
        self.cores = len(os.sched_getaffinity(0))
        self._last = self._sample()
        torch.set_num_threads(max_threads)

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        busy, steal = machine_cpu_s()
        return time.monotonic(), busy + steal, process_cpu_s()

    def tick(self) -> None:
        """Look again if INTERVAL has passed; set torch's threads to the cores other processes leave free."""
        if time.monotonic() - self._last[0] < INTERVAL:
            return
        now = self._sample()
        wall = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        threads = max(1, min(self.max_threads, self.cores - int(others / BUSY)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


_governor: ThreadGovernor | None = None


def govern(max_threads: int) -> None:
    """From now on the engine's steps run on at most max_threads threads, fewer while other processes keep cores."""
    global _governor
    _governor = ThreadGovernor(max_threads)


def tick() -> None:
    """Called before each engine step: adjust the threads if the governor is on and due."""
    if _governor is not None:
        _governor.tick()


def stop(fixed: int) -> None:
    """Turn the governor off: the steps run on `fixed` threads whatever the machine does."""
    global _governor
    _governor = None
    torch.set_num_threads(fixed)
