"""python -m pipeline.tools.crash [--kills 10] [--stages ...] [--seed 0] [overrides]: stages killed with SIGKILL at
random moments, then `dvc repro` again. In a scratch copy of the repository (pipeline/tools/scratch.py; params from
SMALL and the overrides, the real model by default), after one whole `dvc repro`, each trial forces one stage
(`dvc repro -f -s <stage>`) and kills it at a moment drawn uniformly within that stage's own duration: by turns the
stage's process alone (as the OOM killer does) and the whole job's process group, dvc included (as a pre-empted batch
job is). Then: no process of the copy may be left; every output must be whole (JSON parsed, parquet read, PNG to its
last chunk, text decoded) and the killed stage's files all its previous ones or all new (never a mix); `dvc repro`
must finish, `dvc status` show nothing but the always-changed fingerprint, and every output be whole again. Last,
--full-disk stages run again with reports/ and data/ on filesystems that fill (full_disk). Writes reports/crash.json;
exits 1 if a trial fails."""
import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from engine.children import dies_with_parent
from engine.model.integrity import folder_damage
from pipeline.config import ROOT
from pipeline.measuring.fingerprint import environment
from pipeline.results import write_json
from pipeline.tools.scratch import SMALL, copy_env, scratch_copy, sh

STAGES = ["prepare_model", "probe_hardware", "bench_engine", "bench_server", "report"]
PNG_END = b"IEND\xaeB`\x82"  # a PNG's last chunk


def whole(path: Path) -> str | None:
    """Why the output file at `path` is not whole (cut short, unreadable), or None."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".parquet":
            pq.read_table(path)
        elif path.suffix == ".png":
            if not path.read_bytes().endswith(PNG_END):
                return "a PNG without its last chunk"
        elif not path.read_bytes().decode() and path.suffix in (".md", ".csv"):
            return "empty"
    except Exception as exc:  # whatever the reader raised is the reason
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def outputs(repo: Path) -> dict[str, dict[str, str]]:
    """Each stage's output files and their md5 as dvc.lock records them (a folder output: its files on disk)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    out = {}
    for stage, entry in lock.items():
        files = {}
        for o in entry.get("outs", []):
            path = repo / o["path"]
            if path.is_dir():
                files.update({str(f.relative_to(repo)): "" for f in path.rglob("*") if f.is_file()})
            else:
                files[o["path"]] = o.get("md5", "")
        out[stage] = files
    return out


def damaged(repo: Path) -> dict[str, str]:
    """Every output file of the pipeline that is missing or not whole, with why."""
    bad = {}
    for files in outputs(repo).values():
        for f in files:
            path = repo / f
            why = "missing" if not path.exists() else whole(path)
            if why:
                bad[f] = why
    return bad


def left_behind(repo: Path) -> list[str]:
    """Processes still running in the copy (their working folder inside it), as 'pid: command'."""
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(d / "cwd")).is_relative_to(repo):
                command = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{d.name}: {command[:200]}")
        except OSError:
            continue
    return found


def stage_process(repo: Path, stage: str) -> int | None:
    """The pid of the stage's own process (python -m pipeline.stages.<module>) in the copy, or None."""
    module = f"pipeline.stages.{stage.split('@')[0]}"
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if module.encode() in cmd and Path(os.readlink(d / "cwd")) == repo:
                return int(d.name)
        except OSError:
            continue
    return None


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest() if path.exists() else ""


def trial(repo: Path, stage: str, whole_job: bool, rng: random.Random, seconds: float) -> dict:
    """Force `stage`, kill it (or its whole job) at a random moment of its run, and check what is left. For
    prepare_model the prepared folder is removed first, so that the kill lands mid-preparation; the next process that
    needs the model must find the folder damaged and prepare it again."""
    before = outputs(repo)[stage]
    folder = repo / yaml.safe_load((repo / "params.yaml").read_text())["model"]["path"]
    if stage == "prepare_model":
        shutil.rmtree(folder, ignore_errors=True)
    job = subprocess.Popen(["dvc", "repro", "-f", "-s", stage], cwd=repo, env=copy_env(), start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=dies_with_parent())
    pid, started = None, time.monotonic()
    while pid is None and job.poll() is None and time.monotonic() - started < 120:
        pid = stage_process(repo, stage)
        time.sleep(0.02)
    at = rng.uniform(0.0, seconds)
    time.sleep(at)
    killed = job.poll() is None and pid is not None
    if killed:
        os.killpg(job.pid, signal.SIGKILL) if whole_job else os.kill(pid, signal.SIGKILL)
    job.wait()
    time.sleep(2.0)  # children get their parent-death signal
    files = {f: md5(repo / f) for f in before if before[f]}
    kept = sum(files[f] == before[f] for f in files)
    result = {"stage": stage, "killed": "the job" if whole_job else "the stage", "after_s": round(at, 2),
              "hit": killed, "left_behind": left_behind(repo), "damaged_after_kill": damaged(repo),
              "files_kept": kept, "files_new": len(files) - kept}
    t = time.monotonic()
    try:
        ran = sh("dvc repro", repo).count("Running stage")
        status = sh("dvc status", repo)
        stale = [line for line in status.splitlines() if line and not line[0].isspace() and "up to date" not in line]
        result.update(repro_ok=True, repro_s=round(time.monotonic() - t, 1), stages_rerun=ran,
                      status_clean=stale in ([], ["fingerprint:"]))  # the fingerprint is always changed
    except RuntimeError as exc:
        result.update(repro_ok=False, error=str(exc)[-2000:], status_clean=False)
    result["damaged_after_repro"] = damaged(repo)
    if stage == "prepare_model" and result["repro_ok"]:
        sh("python -m pipeline.stages.prepare_model", repo)  # the model, as any stage would ask for it
        result["model_folder_damage"] = folder_damage(folder)
    result["passed"] = (not result["left_behind"] and not result["damaged_after_kill"] and result["repro_ok"]
                        and result["status_clean"] and not result["damaged_after_repro"]
                        and (result["files_kept"] == 0 or result["files_new"] == 0)
                        and result.get("model_folder_damage") is None)
    return result


FULL = """set -e
for d in reports data; do  # each on a filesystem of its own with SLACK KiB free beyond what it holds
  keep=$(mktemp -d); cp -a $d/. $keep/
  mount -t tmpfs -o size=$(( $(du -sk $d | cut -f1) + {slack} ))k tmpfs $d && cp -a $keep/. $d/ && rm -rf $keep
done
find reports data -type f ! -name timings.json -exec sha256sum {{}} + | sort > {before}
if dvc repro -f -s {stage} > {log} 2>&1; then echo "the stage ran on a full disk"; exit 1; fi
find reports data -type f ! -name timings.json -exec sha256sum {{}} + | sort > {after}
"""  # run in a user and mount namespace of its own (unshare -rm): the mounts go with it


def full_disk(repo: Path, stage: str, slack_kib: int = 16) -> dict:
    """Force `stage` with reports/ and data/ on filesystems that fill (SLACK KiB free): the stage must stop with the
    path and the bytes it needed, every file byte for byte as before; then, with room again, `dvc repro` finishes."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {k: Path(tmp) / k for k in ("before", "after", "log")}
        got = subprocess.run(["unshare", "-rm", "sh", "-c", FULL.format(slack=slack_kib, stage=stage, **files)],
                             cwd=repo, env=copy_env(), capture_output=True, text=True, timeout=1800)
        log = files["log"].read_text() if files["log"].exists() else got.stderr
        said = next((line.strip() for line in log.splitlines() if "no room to write" in line), None)
        same = got.returncode == 0 and files["before"].read_text() == files["after"].read_text()
    result = {"stage": stage, "full_disk": f"{slack_kib} KiB free", "message": said, "files_unchanged": same,
              "error": None if got.returncode == 0 else (got.stdout + got.stderr)[-1000:]}
    try:
        sh("dvc repro", repo)
        result["repro_ok"], result["damaged_after_repro"] = True, damaged(repo)
    except RuntimeError as exc:
        result.update(repro_ok=False, damaged_after_repro=None, error=str(exc)[-2000:])
    result["passed"] = bool(said) and same and result["repro_ok"] and not result["damaged_after_repro"]
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split(": ", 1)[1])
    p.add_argument("overrides", nargs="*", help="params overrides for the copy, beside SMALL (e.g. model=tiny-chat)")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--stages", nargs="+", default=STAGES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-disk", nargs="*", default=["report", "bench_engine"],
                   help="stages run again on a full disk (where this machine lets a user mount a filesystem)")
    p.add_argument("--out", default=str(ROOT / "reports" / "crash.json"))
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="lab-crash-") as tmp:
        repo = scratch_copy(Path(tmp), [*SMALL, *a.overrides])
        t = time.monotonic()
        sh("dvc repro", repo)
        print(f"whole pipeline: {time.monotonic() - t:.0f} s", flush=True)
        took = json.loads((repo / "reports" / "timings.json").read_text())["stages"]
        trials = []
        for i in range(a.kills):
            stage = a.stages[i % len(a.stages)]
            trials.append(trial(repo, stage, i // len(a.stages) % 2 == 1, rng, took[stage]["seconds"]))
            print(json.dumps({k: v for k, v in trials[-1].items() if k != "error"}), flush=True)
        disk = []
        if shutil.which("unshare") and not subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
            for stage in a.full_disk:
                disk.append(full_disk(repo, stage))
                print(json.dumps(disk[-1]), flush=True)
    out = {"machine": environment(), "overrides": [*SMALL, *a.overrides], "trials": trials, "full_disk": disk,
           "hits": sum(t["hit"] for t in trials), "passed": all(t["passed"] for t in trials + disk)}
    write_json(a.out, out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
