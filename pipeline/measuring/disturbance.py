"""What the machine did while a run was timed, and whether that disturbed it. The machine's busy and steal time
come from /proc/stat, the run's own CPU from its process (and any server processes it drives); other work is
engine.usage.other_cpu_share (other processes and steal). A run is disturbed when other work took more CPU than
`measure.other_cpu_max` or steal alone more than `measure.steal_max` (conf/config.yaml). A disturbed run is measured
again up to `measure.tries` times, then kept and labelled."""
import os
import sys
from dataclasses import asdict, dataclass

from engine.usage import cpu_times, other_cpu_share


class ImpossibleFigure(ValueError):
    """A result that cannot be true (a negative or non-finite rate, a part longer than its whole)."""


@dataclass(frozen=True)
class Disturbance:
    wall_s: float
    other_cpu_share: float             # other work's CPU seconds per wall second (other processes and steal)
    steal_share: float                 # CPU seconds the hypervisor gave away per wall second
    own_cpu_share: float               # the run's own CPU seconds per wall second (its process and servers)
    disturbed: bool
    tries: int = 1                     # runs made of it (more than one: earlier ones disturbed or impossible)

    def fields(self) -> dict:
        return asdict(self)


class Watch:
    """`with Watch(limits, pids) as w: ...` then `w.result`: the machine's CPU over the block. pids: processes
    besides this one whose CPU is the run's own (a server under load)."""

    def __init__(self, limits, pids=()):
        self.limits, self.pids = limits, list(pids)

    def __enter__(self):
        self._start = cpu_times(self.pids)
        return self

    def __exit__(self, *exc):
        a, b = self._start, cpu_times(self.pids)
        t = max(b.wall_s - a.wall_s, 1e-9)
        other, steal = other_cpu_share(a, b), (b.steal_s - a.steal_s) / t
        self.result = Disturbance(t, other, steal, (b.own_s - a.own_s) / t,
                                  other > float(self.limits.other_cpu_max) or steal > float(self.limits.steal_max))


def measured(fn, limits, label: str, pids=(), check=None):
    """fn() under a Watch, again while disturbed or impossible (check(result) raises ImpossibleFigure), at most
    limits.tries times: (the last result, its Disturbance with the tries made). Every try disturbed: said loudly."""
    tries = max(1, int(limits.tries))
    for attempt in range(1, tries + 1):
        with Watch(limits, pids) as w:
            out = fn()
        try:
            if check is not None:
                check(out)
        except ImpossibleFigure as exc:
            if attempt == tries:
                raise
            print(f"{label}: {exc}; measuring again", file=sys.stderr, flush=True)
            continue
        d = Disturbance(**{**w.result.fields(), "tries": attempt})
        if not d.disturbed:
            return out, d
        print(f"{label}: disturbed (other processes {d.other_cpu_share:.2f} CPUs, steal {d.steal_share:.2f}); "
              + ("measuring again" if attempt < tries else f"kept as disturbed after {tries} tries"),
              file=sys.stderr, flush=True)
    return out, d


def server_pids(proc) -> list[int]:
    """A server process's pid while it runs, for a Watch (its CPU is the run's own)."""
    return [proc.pid] if proc is not None and os.path.exists(f"/proc/{proc.pid}") else []
