"""The process's peak memory over a timed block (engine.machine.PeakRSS): the kernel's high-water mark, reset on entry,
with no thread running beside the measured work."""
import os
import threading

import pytest
import torch

from engine.machine import PeakRSS, rss_mb


def test_peak_covers_memory_freed_inside_the_block():
    threads = threading.active_count()
    with PeakRSS() as rss:
        assert threading.active_count() == threads  # nothing samples beside the work
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert rss.peak_mb >= rss_mb() + 60


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="the kernel's peak cannot be reset here")
def test_each_block_has_its_own_peak():
    with PeakRSS():
        x = torch.ones(128 * 2**20 // 4)
        del x
    with PeakRSS() as second:
        pass
    assert second.peak_mb < rss_mb() + 60
