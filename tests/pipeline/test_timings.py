"""reports/timings.json's writer, and a stage stopped by SIGTERM stopping what it started."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.timings import timed_stage

ROOT = Path(__file__).resolve().parents[2]


def test_a_stage_records_its_seconds_under_its_name(tmp_path):
    path = tmp_path / "timings.json"
    with timed_stage("one", path=path):
        time.sleep(0.2)
    with timed_stage("two", path=path):
        pass
    out = json.loads(path.read_text())
    assert set(out["stages"]) == {"one", "two"} and out["stages"]["one"]["seconds"] >= 0.2
    assert out["total_seconds"] == round(sum(s["seconds"] for s in out["stages"].values()), 1)


def test_a_stopped_stage_stops_the_process_it_started(tmp_path):
    """SIGTERM (dvc's or a user's kill) unwinds the stage, so its `finally` stops a server it started."""
    script = ("import subprocess, sys, time\nfrom pathlib import Path\nfrom pipeline.timings import timed_stage\n"
              f"with timed_stage('x', path=Path({str(tmp_path / 't.json')!r})):\n"
              "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "    try:\n        print(child.pid, flush=True)\n        time.sleep(60)\n"
              "    finally:\n        child.kill()\n        child.wait()\n")
    stage = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(stage.stdout.readline())
    stage.send_signal(signal.SIGTERM)
    assert stage.wait(timeout=30) == 128 + signal.SIGTERM
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text()
    assert not (tmp_path / "t.json").exists()  # a stopped stage records no time
