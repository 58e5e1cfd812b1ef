"""What this process spends: its memory (resident, peak, what glibc keeps of what it frees) and the CPU time the
machine and a process spent."""
import ctypes
import os
import time
from dataclasses import dataclass


def rss_mb(field: str = "VmRSS", pid: int | str = "self") -> float:
    """Resident set size of a process (VmRSS), or its peak (VmHWM), MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6  # the kernel counts KiB
    return 0.0


def held(pid: int | str = "self") -> dict:
    """What a live process holds now: resident memory (MB), OS threads (torch's and OpenMP's included), open files
    (sockets included)."""
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"rss_mb": rss_mb(pid=pid), "threads": threads, "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


MMAP_LIMIT = 32 * 2**20  # bytes: larger allocations get fresh pages from the kernel (glibc's upper bound)
TRIM_LIMIT = 256 * 2**20  # bytes: free heap kept for later allocations before any goes back to the kernel
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _libc():
    """glibc's malloc controls, or None where the C library is another."""
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Keep what the process frees for its next allocations: a step's temporaries (its activations, logits, up to
    MMAP_LIMIT each) are freed and allocated again every step; glibc by default hands such blocks back to the kernel
    and takes fresh ones, which the kernel maps and zeroes page by page (764 page faults a 64-row bf16 step here).
    Process-wide; False where the C library is not glibc."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_LIMIT) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_LIMIT))


def release_freed_memory() -> None:
    """Hand the free memory retain_freed_memory keeps back to the kernel (glibc), so that a memory figure taken next
    counts what is in use."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


class PeakRSS:
    """.peak_mb: this process's peak resident set size over the block, MB, from the kernel's high-water mark
    (VmHWM), reset on entry (where the kernel refuses the reset: the peak since the process started) after the free
    memory the process keeps is released. No sampling thread, which would take a core from the measured work."""

    def __enter__(self):
        release_freed_memory()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.peak_mb = 0.0
        return self

    def __exit__(self, *exc):
        self.peak_mb = rss_mb("VmHWM")


TICK = os.sysconf("SC_CLK_TCK")  # the kernel's CPU time unit, per second


def machine_cpu_s() -> tuple[float, float]:
    """(CPU seconds all cores spent busy, CPU seconds stolen by the hypervisor) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal guest ...
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / TICK, (v[7] if len(v) > 7 else 0) / TICK


def process_cpu_s(pid: int | str = "self") -> float:
    """CPU seconds a live process has used (all its threads, and its children it has waited for); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime


@dataclass(frozen=True)
class CpuTimes:
    """One reading of the clock and the CPU seconds spent since boot."""
    wall_s: float    # time.perf_counter()
    busy_s: float    # all cores busy
    steal_s: float   # stolen by the hypervisor
    own_s: float     # the watched processes' own: this one and the pids named


def cpu_times(pids=()) -> CpuTimes:
    """The clock, the machine's busy and stolen CPU seconds, and this process's and `pids`' own, read now."""
    busy, steal = machine_cpu_s()
    return CpuTimes(time.perf_counter(), busy, steal, process_cpu_s() + sum(process_cpu_s(p) for p in pids))


def other_cpu_share(start: CpuTimes, end: CpuTimes) -> float:
    """Other work's CPUs between two readings, CPU seconds per wall second: the machine's busy and stolen time less
    the watched processes' own. Steal counts as other work: it is time another guest took from this machine's cores,
    time the watched work could have run in."""
    used = (end.busy_s - start.busy_s) + (end.steal_s - start.steal_s) - (end.own_s - start.own_s)
    return max(0.0, used) / max(end.wall_s - start.wall_s, 1e-9)
