"""The environment every results file carries: library versions, device, threads."""
import os
import platform
import threading
import time

import torch
import transformers


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str = "cpu") -> dict:
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": gpu or cpu_name(), "threads": torch.get_num_threads(), "cpus": os.cpu_count()}


def rss_mb() -> float:
    """Resident set size of this process now, MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRSS:
    """Samples this process's RSS every `period` s while the block runs; .peak_mb is the largest seen."""

    def __init__(self, period: float = 0.01):
        self.period, self.peak_mb = period, 0.0
        self._stop = threading.Event()

    def _watch(self):
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, rss_mb())
            time.sleep(self.period)

    def __enter__(self):
        self.peak_mb = rss_mb()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, rss_mb())
