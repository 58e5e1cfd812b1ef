"""How long each stage took: reports/timings.json ({"machine": {id, label}, "stages": {stage: {seconds, finished}},
"total_seconds"}); a stage's entry is rewritten when it runs, another machine's entries dropped."""
import json
import signal
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone

from pipeline.config import ROOT
from pipeline.results import together, write_json

TIMINGS = ROOT / "reports" / "timings.json"
MACHINE = ROOT / "reports" / "machine.json"


def _stopped(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def timed_stage(name: str | None = None, path=TIMINGS):
    """Time the block as stage `name` (default: the running module's name) and record it when the block ends
    without an error, under the machine of reports/machine.json (this one's fingerprint where there is none); the
    block's result files land together at its end (pipeline.results.together)."""
    name = name or sys.argv[0].rsplit("/", 1)[-1].removesuffix(".py")
    signal.signal(signal.SIGTERM, _stopped)  # a stopped stage unwinds: the servers it started are stopped too
    t = time.perf_counter()
    with together():  # the stage's outputs land together when it ends, or none of them
        yield
    record(name, time.perf_counter() - t, path)


def record(name: str, seconds: float, path) -> None:
    """The stage's entry in the timings file."""
    try:
        machine = json.loads(MACHINE.read_text())
    except (OSError, ValueError):
        from pipeline.measuring.fingerprint import environment  # torch: only where no stage has fingerprinted yet

        machine = environment()
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    stages = old.get("stages", {}) if old.get("machine", {}).get("id") == machine["id"] else {}
    stages[name] = {"seconds": round(seconds, 1), "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json(path, {"machine": {"id": machine["id"], "label": machine["label"]}, "stages": stages,
                      "total_seconds": round(sum(s["seconds"] for s in stages.values()), 1)})
