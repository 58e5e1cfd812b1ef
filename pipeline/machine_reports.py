"""Keep an experiment's reports beside the main ones: `python -m pipeline.machine_reports <experiment name>` copies
reports/ of the newest DVC experiment of that name (`dvc exp run --temp -n <name>`, as `make gpu-check` runs it) into
reports/machines/<its machine fingerprint id>/, so a GPU's reports never replace the CPU's."""
import json
import subprocess
import sys

from pipeline.config import ROOT
from pipeline.io import write_bytes


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def experiment_ref(name: str) -> str:
    """The git ref of the newest experiment called `name`."""
    refs = [r for r in git("for-each-ref", "--sort=-committerdate", "--format=%(refname)", "refs/exps").split()
            if r.rsplit("/", 1)[-1] == name]
    if not refs:
        raise SystemExit(f"no DVC experiment named {name!r} (see `dvc exp list`)")
    return refs[0]


def main(name: str) -> None:
    ref = experiment_ref(name)
    machine = json.loads(git("show", f"{ref}:reports/machine.json"))
    out = ROOT / "reports" / "machines" / machine["id"]
    for path in git("ls-tree", "-r", "--name-only", ref, "reports/").split():
        if path.startswith("reports/machines/"):
            continue
        data = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
        write_bytes(out / path.removeprefix("reports/"), data)
    print(f"reports of experiment {name!r} ({machine['label']}) in {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu-check")
