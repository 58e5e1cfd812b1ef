"""Each Python peer's own virtual environment, data/peers/<peer>/venv: created once with `python3 -m venv`, its
packages installed once from the package index (the INSTALLED marker names them), never the lab's .venv; run
offline. A peer that cannot run here is a Refused with the reason its own error gave."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.config import ROOT

logger = logging.getLogger("pipeline.peers")
PEERS = ROOT / "data" / "peers"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PIP_NO_INDEX": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # nothing fetched at run time


CHECK = """import importlib.metadata as m, sys
for name in sys.argv[1:]:
    try:
        d = m.distribution(name)
    except m.PackageNotFoundError:
        sys.exit(f"lacks {name}")
    for f in d.files or ():
        p = d.locate_file(f)
        if f.size is not None and (not p.exists() or p.stat().st_size != f.size):
            size = p.stat().st_size if p.exists() else "no"
            sys.exit(f"has {p} of {size} bytes, {f.size} as {name} installed it (truncated or damaged)")
"""  # run by a venv's python: each wanted package's files against its RECORD's sizes


class Refused(RuntimeError):
    """A peer that cannot run here; str() is the reason, from the peer's own error."""


def reason(log: str, limit: int = 300) -> str:
    """The line of a peer's output that says why it failed: the last one naming an error, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    named = [line for line in lines if "error" in line.lower() or "not supported" in line.lower()]
    why = (named or lines or ["no output"])[-1]
    return why if len(why) <= limit else why[:limit] + "..."


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def isolated(venv: Path) -> Path:
    """The venv's python, once it is shown not to be the lab's: its sys.prefix is the venv, not this process's."""
    py = python_of(venv)
    if not py.exists():
        raise Refused(f"{venv.relative_to(ROOT) if venv.is_relative_to(ROOT) else venv} has no python")
    prefix = subprocess.run([str(py), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    if Path(prefix).resolve() in (Path(sys.prefix).resolve(), (ROOT / ".venv").resolve()):
        raise RuntimeError(f"{py} is the lab's own python ({prefix}): a peer never installs into the lab's .venv")
    if Path(prefix).resolve() != venv.resolve():
        raise RuntimeError(f"{py} runs in {prefix}, not in {venv}")
    return py


def install_commands(venv: Path, packages: list[str], remove: list[str]) -> list[list[str]]:
    """The commands that make a venv: created with python3 -m venv, `packages` installed, `remove` uninstalled."""
    py = str(python_of(venv))
    cmds = [["python3", "-m", "venv", str(venv)], [py, "-m", "pip", "install", "--upgrade", "pip"],
            [py, "-m", "pip", "install", *packages]]
    return cmds + ([[py, "-m", "pip", "uninstall", "-y", *remove]] if remove else [])


def ensure(name: str, packages: list[str], remove: list[str], peers: Path = PEERS) -> Path:
    """data/peers/<name>/venv's python with `packages` installed and `remove` uninstalled, made once (again only for
    another list); a failed install is a Refused with pip's reason."""
    venv = peers / name / "venv"
    marker, wanted = venv / "INSTALLED", json.dumps({"packages": packages, "remove": remove})
    if marker.exists() and marker.read_text().strip() == wanted:
        why = damage(venv, packages)
        if why is None:
            return isolated(venv)
        logger.warning("%s's venv %s: installing it again", name, why)
        shutil.rmtree(venv, ignore_errors=True)
    installed = peers / name / "install.log"
    installed.parent.mkdir(parents=True, exist_ok=True)
    print(f"{name}: installing {' '.join(packages)} into {venv.relative_to(ROOT)} (minutes)", flush=True)
    with installed.open("w") as out:
        for cmd in install_commands(venv, packages, remove):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(), check=False).returncode:
                raise Refused(f"`{' '.join(cmd[1:4])} ...` failed: {reason(installed.read_text())}")
    py = isolated(venv)
    marker.write_text(wanted + "\n")
    return py


def damage(venv: Path, packages: list[str]) -> str | None:
    """Why the venv is not as it was installed (its python does not run; a file of a wanted package missing or of
    another size than its RECORD says), or None."""
    dists = [re.split(r"[<>=!~\[;@ ]", spec, maxsplit=1)[0] for spec in packages]
    try:
        out = subprocess.run([str(python_of(venv)), "-I", "-c", CHECK, *dists], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"has a python that does not run ({exc})"
    return None if out.returncode == 0 else reason(out.stderr)


def version(py: Path, dist: str) -> str:
    """The installed version of distribution `dist` in the venv of `py`."""
    return subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def freeze() -> list[str]:
    """The lab's own environment as `pip freeze` lists it (compared before and after the peers run)."""
    return subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def clean_env() -> dict:
    """This process's environment (an isa level's limits included) without the lab's venv: off PATH, so that
    `python3` is the system's."""
    lab_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != lab_bin)
    return {**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}, "PATH": path}


def run_env(threads: int) -> dict:
    """The environment a peer's process runs in: clean_env, offline, `threads` OpenMP threads."""
    return {**clean_env(), **OFFLINE, "OMP_NUM_THREADS": str(threads)}
