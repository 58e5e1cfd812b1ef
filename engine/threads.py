"""Intra-op threads that follow the free cores: a 2-thread step beside a busy process on one of 2 cores stalls at
every parallel region's barrier (one thread waits for the other's turn on its core), so a lost core costs far more
than its share. Every `measure.governor_interval_s` the governor measures the CPU other work used
(engine.usage.other_cpu_share) and runs the steps on the cores left (at least one, at most the configured
threads); each `measure.busy_per_core` CPUs of other work take a core away (conf/config.yaml)."""
import os
import time

import torch

from engine.usage import CpuTimes, cpu_times, other_cpu_share


class ThreadGovernor:
    def __init__(self, max_threads: int, busy_per_core: float, interval_s: float):
        self.max_threads, self.busy_per_core, self.interval_s = max_threads, busy_per_core, interval_s
        self.cores = len(os.sched_getaffinity(0))
        self._last = self._sample()
        torch.set_num_threads(max_threads)

    @staticmethod
    def _sample() -> CpuTimes:
        return cpu_times()

    def tick(self) -> None:
        """Look again if interval_s has passed; set torch's threads to the cores other work leaves free."""
        if time.perf_counter() - self._last.wall_s < self.interval_s:
            return
        now = self._sample()
        others = other_cpu_share(self._last, now)
        self._last = now
        threads = max(1, min(self.max_threads, self.cores - int(others / self.busy_per_core)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


_governor: ThreadGovernor | None = None


def govern(max_threads: int, measure) -> None:
    """From now on the engine's steps run on at most max_threads threads, fewer while other work keeps cores.
    measure: a composed config's `measure` (busy_per_core, governor_interval_s)."""
    global _governor
    _governor = ThreadGovernor(max_threads, float(measure.busy_per_core), float(measure.governor_interval_s))


def tick() -> None:
    """Called before each engine step: adjust the threads if the governor is on and due."""
    if _governor is not None:
        _governor.tick()


def stop(fixed: int) -> None:
    """Turn the governor off: the steps run on `fixed` threads whatever the machine does."""
    global _governor
    _governor = None
    torch.set_num_threads(fixed)
