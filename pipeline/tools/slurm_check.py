"""make slurm-check: a sweep through a real SLURM cluster, on this machine.

Installs Debian's slurm-wlm and munge where slurmctld is missing (as root), starts munged and a one-node cluster on
loopback (slurmctld and slurmd, a slurm.conf written for this machine's cores and memory in a scratch folder), submits
a two-job sweep through `hydra/launcher=slurm` (pipeline.tools.sweep, each job an engine replay on a tiny model),
waits, checks that the sweep table has both rows, and stops the cluster whatever happened. The cluster keeps no
accounting, so submitit's calls to sacct fail (its warnings) and it reads each job's result file instead. On your own
cluster the same sweep is one command:
    python -m pipeline.tools.sweep -m hydra/launcher=slurm hydra.launcher.partition=<yours> ...
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.config import ROOT

PACKAGES = ["slurm-wlm", "munge"]
JOBS = ["policy=dynamic,continuous"]  # the sweep's axis: two jobs
SMALL = ["model=tiny-llama", "profile.requests_scale=1", "workload.num_requests=6", "workload.output.mean=6",
         "load=closed"]


def install() -> None:
    """Debian's packages where slurmctld is missing (apt-get, as root)."""
    if all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise SystemExit(f"slurm-check: slurmctld is missing; as root, apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], check=True, env=env)


def slurm_conf(folder: Path) -> str:
    """A one-node cluster on loopback: this machine's cores and memory, state and logs under `folder`."""
    cores = os.cpu_count() or 1
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 9 // 10
    return "\n".join([
        "ClusterName=lab", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        "SlurmctldPort=6817", "SlurmdPort=6818", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
        "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cores} RealMemory={memory_mb} State=UNKNOWN",
        "PartitionName=lab Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""])


def wait_for(what: str, check, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise RuntimeError(f"slurm-check: {what} did not happen within {timeout_s:g} s")
        time.sleep(1)


def node_idle(env: dict) -> bool:
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
    return out.returncode == 0 and "idle" in out.stdout


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start(folder: Path, env: dict) -> None:
    """munged (with a key of its own if the machine has none), slurmctld, slurmd."""
    for d in ("state", "spool", "munge"):
        (folder / d).mkdir()
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
    subprocess.run(["munged", "--force", f"--socket={folder}/munge/socket", f"--pid-file={folder}/munge/pid",
                    f"--log-file={folder}/munge/log", f"--seed-file={folder}/munge/seed"], check=True)
    Path(folder / "slurm.conf").write_text(slurm_conf(folder) + f"AuthInfo=socket={folder}/munge/socket\n")
    subprocess.run(["slurmctld"], env=env, check=True)
    wait_for("slurmctld listening", lambda: port_open(6817))
    subprocess.run(["slurmd", "-N", "localhost"], env=env, check=True)
    wait_for("the node idle", lambda: node_idle(env))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(folder: Path, env: dict) -> list[str]:
    """Shut the cluster down (scontrol shutdown), then munged; what still runs after 20 s is killed. Returns the
    daemons found running at the end (none when it worked)."""
    pids = {name: int(f.read_text().split()[0]) for name, f in (
        ("slurmctld", folder / "slurmctld.pid"), ("slurmd", folder / "slurmd.pid"), ("munged", folder / "munge/pid"))
        if f.exists()}
    subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
    if "munged" in pids:
        os.kill(pids["munged"], signal.SIGTERM)
    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in (p for p in pids.values() if alive(p)):
        os.kill(pid, signal.SIGKILL)
    return [name for name in ("slurmctld", "slurmd", "munged")
            if subprocess.run(["pgrep", "-x", name], capture_output=True).returncode == 0]


def sweep(folder: Path, env: dict) -> dict:
    """The two-job sweep through hydra/launcher=slurm; its table (sweep.json)."""
    out = folder / "sweep"
    cmd = [sys.executable, "-m", "pipeline.tools.sweep", "-m", "hydra/launcher=slurm", "hydra.launcher.partition=lab",
           "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=20",
           f"hydra.sweep.dir={out}", *SMALL, *JOBS]
    print("slurm-check:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=1800)
    return json.loads((out / "sweep.json").read_text())


def main() -> None:
    install()
    folder = Path(tempfile.mkdtemp(prefix="slurm-check-"))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    try:
        start(folder, env)
        table = sweep(folder, env)
    finally:
        left = stop(folder, env)
    rows = [(r["point"], r["complete"], r["requests"]) for r in table["rows"]]
    print(f"slurm-check: {len(rows)} SLURM jobs, sweep table rows {rows}; cluster stopped, daemons left: "
          f"{left or 'none'}")
    if len(rows) != 2 or any(done != n for _, done, n in rows) or left:
        raise SystemExit(f"slurm-check failed: rows {rows}, daemons still running {left}; logs in {folder}")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
