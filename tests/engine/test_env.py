"""The process's memory: its peak over a timed block (engine.usage.PeakRSS: the kernel's high-water mark, reset on
entry, with no thread running beside the measured work), and what the engine's steps keep for reuse."""
import mmap
import os
import resource
import statistics
import threading

import pytest
import torch

from engine import SamplingParams
from engine.factory import build_engine, build_net
from engine.specs import PolicySpec, PrecisionSpec
from engine.usage import PeakRSS, retain_freed_memory, rss_mb


def test_peak_covers_memory_freed_inside_the_block():
    before = set(threading.enumerate())
    with PeakRSS() as rss:
        assert not set(threading.enumerate()) - before  # nothing samples beside the work (a thread may have ended)
        pages = mmap.mmap(-1, 64 * 2**20)  # 64 MiB of fresh pages, whatever the allocator keeps
        for i in range(0, len(pages), mmap.PAGESIZE):
            pages[i] = 1  # touched: resident
        pages.close()
    assert rss.peak_mb >= rss_mb() + 60


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="the kernel's peak cannot be reset here")
def test_each_block_has_its_own_peak():
    with PeakRSS():
        x = torch.ones(128 * 2**20 // 4)
        del x
    with PeakRSS() as second:
        pass
    assert second.peak_mb < rss_mb() + 60


def test_memory_kept_for_reuse_is_not_counted_in_a_later_peak():
    if not retain_freed_memory():
        pytest.skip("the C library is not glibc")
    before = rss_mb()
    x = [torch.ones(4 * 2**20 // 4) for _ in range(32)]  # 128 MiB in 4 MiB blocks, freed and kept
    del x
    with PeakRSS() as rss:
        pass
    assert rss.peak_mb < before + 60


def test_a_warm_engine_maps_no_new_memory_each_step(smollm2):
    """A 64-row decode step frees and allocates the same temporaries every step (12 MB of logits among them); they
    come back from the process's own free memory, not as fresh pages (the kernel's minor faults). The median step
    counts: the kernel itself now and then remaps a step's pages at once (a burst of thousands in one step, seen on
    some machines whatever the engine does), while memory handed back every step faults in every step."""
    model, tok = smollm2
    net = build_net(model, PrecisionSpec(weights="bf16", kv_dtype="bfloat16"))
    eng = build_engine(net, PolicySpec.of("continuous", 64), 64)
    for i in range(64):
        eng.add_request(str(i), [1 + i, 2, 3, 4], SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    faults = []
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        eng.step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert statistics.median(faults) < 20, faults
