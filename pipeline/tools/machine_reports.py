"""`python -m pipeline.tools.machine_reports [experiment name]` (default gpu-check): copy reports/ of the newest DVC
experiment of that name into reports/machines/<its machine id>/, so another machine's reports never replace these."""
import json
import subprocess
import sys
from pathlib import Path

from engine.config import ROOT
from pipeline.results import write_bytes


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def experiment_ref(root: Path, name: str) -> str:
    """The git ref of the newest experiment called `name`."""
    refs = [r for r in git(root, "for-each-ref", "--sort=-committerdate", "--format=%(refname)", "refs/exps").split()
            if r.rsplit("/", 1)[-1] == name]
    if not refs:
        raise SystemExit(f"no DVC experiment named {name!r} (see `dvc exp list`)")
    return refs[0]


def keep(name: str, root: Path = ROOT) -> None:
    ref = experiment_ref(root, name)
    machine = json.loads(git(root, "show", f"{ref}:reports/machine.json"))
    out = root / "reports" / "machines" / machine["id"]
    for path in git(root, "ls-tree", "-r", "--name-only", ref, "reports/").split():
        if path.startswith("reports/machines/"):
            continue
        data = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=root, check=True, capture_output=True).stdout
        write_bytes(out / path.removeprefix("reports/"), data)
    print(f"reports of experiment {name!r} ({machine['label']}) in {out.relative_to(root)}")


if __name__ == "__main__":
    keep(sys.argv[1] if len(sys.argv) > 1 else "gpu-check")
