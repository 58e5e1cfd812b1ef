"""A scratch copy of the repository for trials of the whole pipeline (tests/pipeline/test_pipeline.py,
pipeline.tools.crash): its tracked and unignored files without the measured reports and dvc.lock, in a git repository
of its own, with params.yaml composed from overrides and committed. SMALL: overrides that make `dvc repro` a matter of
minutes on any model."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.config import ROOT

SMALL = [
    "bench.server.break_static.timeout_s=2",  # the break-it case waits this long for nothing
    "measure.tries=1",  # a measurement disturbed by other work is kept as such, not retried
    "~computed.dgx-spark",  # one computed GPU report
    "tables=[main,prefill_stall,all_policies,kv_memory,shared_prefix,preemption]",  # a table's stages run one code
    "bench.server.runs=[{name:engine-continuous,server:engine,policy:continuous,max_running:64,levels:[1,64],"
    "n:4,mixed:true}]",  # one engine server, mixed lengths too (the break-it case starts the batcher server)
    "bench.precision.sequences=8", "bench.precision.tokens=64", "bench.precision.greedy_requests=8",  # a short stream
    "bench.shaped.simulated.workloads=[azure-conv,azure-code]", "bench.shaped.simulated.multiples=[0.05,0.2,1.0]",
    "bench.shaped.measured.workloads=[azure-conv]",  # the production-shaped grid, smaller
    "fleet.requests=12", "fleet.seconds=1", "fleet.routers.workloads={mooncake-sessions:[0.4]}",  # the fleet
    "fleet.split.workloads=[azure-code]", "fleet.split.shares=[0.5]", "fleet.plan.rates=[5,40]",  # report, small
    "bench.fleet.calibrate=4", "bench.fleet.overhead.pairs=4",  # the measured fleet: 8 requests a run (x 0.75)
    'bench.fleet.workloads.mooncake-sessions.overrides=["workload.num_requests=8","workload.prefix.sessions=2"]',
    'bench.fleet.workloads.azure-conv.overrides=["workload.num_requests=8","workload.scale=16"]',
    "bench.speculation.batches=[1,4]", "bench.speculation.max_new_tokens=16",  # speculation's grid, small
]


def copy_env() -> dict:
    """The environment the copy's commands run in: this interpreter's folder first on PATH, git's identity set."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
            "GIT_AUTHOR_NAME": "lab", "GIT_AUTHOR_EMAIL": "lab@localhost", "GIT_COMMITTER_NAME": "lab",
            "GIT_COMMITTER_EMAIL": "lab@localhost"}


def sh(cmd: str, cwd: Path, timeout_s: float = 1800) -> str:
    """Run a shell command in the copy; its output, or an error with the end of it."""
    out = subprocess.run(cmd, shell=True, cwd=cwd, env=copy_env(), capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"{cmd} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def scratch_copy(dest: Path, overrides: list[str], models: dict[str, Path] | None = None) -> Path:
    """The copy at dest/lab, params.yaml composed from `overrides` and committed; `models`: data/models/<name> links
    to folders already prepared."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    repo = dest / "lab"
    for f in files:
        if (ROOT / f).is_file() and (not f.startswith(("reports/", "dvc.lock")) or f.startswith("reports/models/")):
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    (repo / "data" / "models").mkdir(parents=True, exist_ok=True)
    for name, folder in (models or {}).items():
        (repo / "data" / "models" / name).symlink_to(folder)
    given = " ".join(f"'{o}'" for o in overrides)
    sh(f"git init -q && python -m pipeline.tools.write_params {given} && git add -A && git commit -qm start", repo)
    return repo
