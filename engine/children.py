"""Every child process the lab starts dies with its parent: a stage or tool killed with SIGKILL (the OOM killer, a
pre-empted batch job) leaves no server, compiler or busy loop running behind it; and what such a process left
behind (a file or folder with its process id in the name) is known by that id (gone)."""
import ctypes
import os
import signal
import subprocess
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a process gets when the thread that started it ends


def dies_with_parent():
    """A preexec_fn for subprocess: the child gets SIGKILL when the thread that started it ends, however it ends
    (kill -9, the OOM killer), so that no server or busy loop outlives the stage or tool that started it; a child
    whose parent is already gone by then ends at once. Linux's parent-death signal follows the starting thread, not
    the process: start children from the main thread. None where the C library has no prctl."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # looked up before the fork
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def running(args: list[str], **popen) -> subprocess.Popen:
    """subprocess.Popen(args, **popen) for every child process the lab starts: it dies with its parent
    (dies_with_parent)."""
    return subprocess.Popen(args, preexec_fn=dies_with_parent(), **popen)


def gone(pid: str) -> bool:
    """Whether `pid` (digits from a file name) names no live process: what it left behind is garbage."""
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()
