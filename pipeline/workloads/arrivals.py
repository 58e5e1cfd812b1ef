"""Arrival times drawn from a seeded RNG, in any unit of time (the replay's decode steps, the load generator's seconds):
one function for the in-process replay and the load generator's open loop, so both send the same requests at the
same moments (up to the unit) from the same seed.

`load.process` (conf/load/):
- all_at_once, closed: every arrival at 0 (a closed loop is paced by its replay).
- poisson: exponential gaps of mean 1/rate.
- gamma: gamma gaps of mean 1/rate and shape `burstiness` k (vLLM `--burstiness`, AIPerf `--arrival-smoothness`):
  CV 1/sqrt(k), k = 1 a Poisson process; or, without `burstiness`, shape 1/cv^2 from `cv`.
- onoff: bursts and idle gaps shaped like the Azure code trace; its lengths are in mean gaps (1/rate), so the shape
  is the same in steps or seconds: a `burst_share` of gaps uniform below `burst_gap`, one gap in `idle_every` an idle
  gap uniform in `idle_gap`, the others exponential with the mean that keeps the overall rate at `rate`.
- trace: the gaps of a CSV trace (pipeline.workloads.traces), their shape kept, stretched to the mean rate `rate`.
"""
import numpy as np

from pipeline.workloads.traces import read_trace

PROCESSES = ("all_at_once", "closed", "poisson", "gamma", "onoff", "trace")


def step_rate(load, mean_output: float) -> float:
    """Requests per full-batch decode step at load.multiple x capacity: load.ref_seats rows decoding per step, so a
    request arrives every (mean output length / ref_seats) steps at multiple 1."""
    return load.multiple * load.ref_seats / mean_output


def arrival_steps(rng, n: int, load, mean_output: float) -> np.ndarray:
    """Arrival times in full-batch decode steps (all 0 for all_at_once and closed)."""
    if load.process in ("all_at_once", "closed"):
        return np.zeros(n)
    return arrival_times(rng, n, load, step_rate(load, mean_output))


def arrival_seconds(workload, load, rate: float | None = None) -> np.ndarray:
    """A built workload's arrivals in seconds at `rate` requests/s: its own arrival_steps draw, time-scaled (every
    process's times are its unit draw over the rate). A trace without a rate keeps its timeline x load.time_scale."""
    steps = workload["arrival_steps"].to_numpy(float)
    if load.process in ("all_at_once", "closed"):
        return steps
    if rate is None:
        if load.process != "trace":
            raise ValueError(f"load.process {load.process}: give a rate (requests/s)")
        rate = trace_rate(load.file, len(steps), float(load.time_scale))
    return steps * step_rate(load, float(workload["output_tokens"].mean())) / rate


def arrival_times(rng, n: int, load, rate: float) -> np.ndarray:
    """n arrival times (the first at 0) of `load.process` at a mean of `rate` arrivals per unit of time."""
    if load.process in ("all_at_once", "closed"):
        return np.zeros(n)
    if load.process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif load.process == "gamma":
        k = gamma_shape(load)
        gaps = rng.gamma(k, 1.0 / (rate * k), n)
    elif load.process == "onoff":
        gaps = onoff_gaps(rng, n, load) / rate
    elif load.process == "trace":
        gaps = trace_gaps(load.file, n) / rate
    else:
        raise ValueError(f"load.process {load.process!r}: choose one of {', '.join(PROCESSES)}")
    gaps[0] = 0.0  # the first request starts the run
    return np.cumsum(gaps)


def gamma_shape(load) -> float:
    """The gamma gaps' shape: `burstiness` k, or 1/cv^2 from `cv` (one of the two)."""
    if "burstiness" in load and "cv" in load:
        raise ValueError("load: give gamma arrivals either `burstiness` (shape k) or `cv` (shape 1/cv^2), not both")
    shape = float(load.burstiness) if "burstiness" in load else 1.0 / float(load.cv) ** 2
    if not shape > 0:
        raise ValueError(f"load: gamma arrivals need a positive shape, got {shape}")
    return shape


def onoff_gaps(rng, n: int, load) -> np.ndarray:
    """n gaps in mean gaps (their mean 1): burst, idle or ordinary, as the module says."""
    share, burst, every = float(load.burst_share), float(load.burst_gap), float(load.idle_every)
    lo, hi = (float(x) for x in load.idle_gap)
    p_idle = 1.0 / every
    left = 1.0 - p_idle * (lo + hi) / 2 - share * burst / 2  # mean gaps the ordinary ones must make up
    if not (0 <= share and p_idle + share < 1 and left > 0):
        raise ValueError(f"load onoff: burst_share {share}, burst_gap {burst}, idle_every {every} and idle_gap "
                         f"{[lo, hi]} leave no room for ordinary gaps at the mean rate")
    kind = rng.random(n)
    idle, bursts = kind < p_idle, (kind >= p_idle) & (kind < p_idle + share)
    return np.where(idle, rng.uniform(lo, hi, n),
                    np.where(bursts, rng.uniform(0.0, burst, n), rng.exponential(left / (1 - p_idle - share), n)))


def trace_gaps(path: str, n: int) -> np.ndarray:
    """The first n gaps of a trace, in mean gaps (their mean 1); the first is 0."""
    t = read_trace(path)["arrival_s"].to_numpy()
    if n > len(t):
        raise ValueError(f"{path}: {len(t)} requests in the trace, {n} asked for")
    gaps = np.diff(t[:n], prepend=t[0])
    mean = gaps[1:].mean() if n > 1 else 0.0
    return gaps / mean if mean > 0 else gaps


def trace_rate(path: str, n: int, time_scale: float = 1.0) -> float:
    """The mean arrival rate (per s) of the trace's first n requests, their timeline multiplied by time_scale."""
    t = read_trace(path)["arrival_s"].to_numpy()[:n]
    span = (t[-1] - t[0]) * time_scale
    if not span > 0:
        raise ValueError(f"{path}: the first {n} requests all arrive at once; give the load generator a --rate")
    return (len(t) - 1) / span
