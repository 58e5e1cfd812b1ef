"""Whole or damaged: a prepared model folder against the manifest written with it (each file's size and sha256), and a
file an installed Python package ships against the package's RECORD (the size and sha256 pip installed)."""
import base64
import importlib.metadata
import json
from pathlib import Path

from engine.hardware import sha256

MANIFEST = "lab_prepared.json"  # in a prepared folder: {"files": {name: {"bytes": size, "sha256": hex digest}}}


def write_manifest(folder: Path) -> None:
    """Record every file of `folder`, written whole just before, in its manifest (the last file written)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def folder_damage(folder: Path, checksums: bool = False) -> str | None:
    """Why `folder` is not a whole prepared model (not there, no manifest, a file missing or of another size than
    when prepared; with `checksums`, of another sha256), or None."""
    if not folder.is_dir():
        return "is not there"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        wanted = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"has no readable {MANIFEST} (prepared by an older version, or its preparation was stopped)"
    for name, (size, digest) in wanted.items():
        path = folder / name
        if not path.is_file():
            return f"lacks {name}"
        if path.stat().st_size != size:
            return f"has {name} of {path.stat().st_size} bytes, {size} when prepared (truncated or damaged)"
        if checksums and sha256(path) != digest:
            return f"has {name} of another sha256 than when prepared (damaged)"
    return None


def package_file_damage(package: str, path: Path) -> str | None:
    """Why the file `path` of the installed package `package` (its import name) is not what pip installed (size or
    sha256 against the package's RECORD), with the command that reinstalls it; None where it is, or where no RECORD
    lists it."""
    for name in importlib.metadata.packages_distributions().get(package) or ():
        dist = importlib.metadata.distribution(name)
        for f in dist.files or ():
            if f.hash is None or Path(dist.locate_file(f)).resolve() != path.resolve():
                continue
            fix = f"reinstall it: pip install --force-reinstall --no-deps {name}=={dist.version}"
            size = path.stat().st_size
            if f.size is not None and size != f.size:
                return f"{path} is {size} bytes, {f.size} as package {name} {dist.version} installed it; {fix}"
            value = base64.urlsafe_b64encode(bytes.fromhex(sha256(path))).rstrip(b"=").decode()  # RECORD's encoding
            if f.hash.mode == "sha256" and value != f.hash.value:
                return f"{path} is not what package {name} {dist.version} installed (its sha256 differs); {fix}"
            return None
    return None
