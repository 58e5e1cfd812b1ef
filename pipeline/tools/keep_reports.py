"""`python -m pipeline.tools.keep_reports [experiment name]` (default gpu-check): copy reports/ of the newest DVC
experiment of that name (the files it wrote) beside the main reports, so they never replace them: into
reports/machines/<its machine id>/ when it ran on another machine, else into reports/models/<its model>/ when it ran
another model (REPORT.md's model section reads those)."""
import json
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.config import ROOT
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


def destination(root: Path, ref: str) -> Path:
    """reports/machines/<id> for another machine's experiment, reports/models/<model> for another model's."""
    theirs = json.loads(git(root, "show", f"{ref}:reports/machine.json"))
    ours = json.loads((root / "reports" / "machine.json").read_text())
    if theirs["id"] != ours["id"]:
        return root / "reports" / "machines" / theirs["id"]
    model = yaml.safe_load(git(root, "show", f"{ref}:params.yaml"))["model"]["name"]
    if model != yaml.safe_load((root / "params.yaml").read_text())["model"]["name"]:
        return root / "reports" / "models" / model
    raise SystemExit(f"experiment {ref.rsplit('/', 1)[-1]!r} ran this machine and this model: its reports would "
                     "only repeat the main ones (`dvc exp apply` it to make it the main run)")


def keep(name: str, root: Path = ROOT) -> Path:
    ref = experiment_ref(root, name)
    out = destination(root, ref)
    wrote = git(root, "diff", "--name-only", "--no-renames", "--diff-filter=AM", f"{ref}~1", ref, "--", "reports/")
    for path in {"reports/machine.json", *wrote.split()}:  # not the files it carried from its baseline
        if path.startswith(("reports/machines/", "reports/models/")):
            continue
        data = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=root, check=True, capture_output=True).stdout
        write_bytes(out / path.removeprefix("reports/"), data)
    print(f"reports of experiment {name!r} in {out.relative_to(root)}")
    return out


if __name__ == "__main__":
    keep(sys.argv[1] if len(sys.argv) > 1 else "gpu-check")
