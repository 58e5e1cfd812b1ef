"""Child processes die with their parent: a stage or tool killed with SIGKILL (as the OOM killer does) leaves none of
the processes it started running, neither a server nor the neighbour tool's busy loop."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses that import the lab: seconds each
ROOT = Path(__file__).resolve().parents[2]
SPIN = "from pipeline.tools.neighbour import spin\nspin()\n"
SERVER = ("from omegaconf import OmegaConf\nfrom pipeline.config import compose_config\n"
          "from pipeline.measuring.servers import start\n"
          "cfg = compose_config(['model=tiny-chat', 'threads=1'])\n"
          "run = OmegaConf.create({'name': 'engine', 'server': 'engine', 'policy': 'continuous', 'max_running': 2})\n"
          "start(cfg, run, 256)\n")


def descendants(pid: int) -> set[int]:
    """Every process below pid, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """The process runs (gone or a zombie waiting for its reaper: not)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def left_after_sigkill(script: str) -> list[int]:
    """Run `script` (it starts a child the way the lab does) in a parent process, SIGKILL the parent once the child
    runs, and return the parent's descendants still alive 5 s later (those are then killed)."""
    parent = subprocess.Popen([sys.executable, "-c", script + "print('ready', flush=True)\nimport time\n"
                               "time.sleep(600)\n"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    kids: set[int] = set()
    try:
        assert parent.stdout.readline() == "ready\n", "the parent did not start its child"
        kids = descendants(parent.pid)
        assert kids, "the parent has no child process"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return sorted(k for k in kids if alive(k))
    finally:
        for k in (k for k in kids if alive(k)):
            os.kill(k, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_the_neighbour_tools_busy_loop_dies_with_its_parent():
    assert left_after_sigkill(SPIN) == []


def test_a_server_a_stage_started_dies_with_it(smollm2_tokenizer_dir):
    """bench_server's way: servers.start on a free port, ready; then the stage is killed."""
    assert left_after_sigkill(SERVER) == []
