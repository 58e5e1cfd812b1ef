"""Result writes: a file appears whole or not at all (a half-written result never replaces a good one), a stage's
files land together at its end (together()), a file with no room on its filesystem is refused naming the bytes it
needed (DiskFull), and never with an impossible figure: a negative or non-finite rate, a negative time, size or count,
a part that exceeds its whole (complete > requests) is refused, naming the file and the field's path."""
import errno
import io
import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from engine.children import gone
from pipeline.measuring.disturbance import ImpossibleFigure

RATES = ("_tps", "_gbs", "ratio", "_fraction", "_share", "gflops")  # endings of fields that must be finite and >= 0
AMOUNTS = ("_s", "_ms", "_mb", "_bytes", "tokens", "requests", "complete", "steps")  # >= 0 (NaN: none measured)


def check_figures(obj, where: str = "") -> None:
    """Raise ImpossibleFigure naming `where` and the field for any impossible figure in a result (dicts and lists
    walked whole)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            at = f"{where}.{k}" if where else str(k)
            if isinstance(v, (dict, list)):
                check_figures(v, at)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                if str(k).endswith(RATES) and not (math.isfinite(v) and v >= 0):
                    raise ImpossibleFigure(f"{at} = {v}: a rate must be finite and >= 0")
                if str(k).endswith(AMOUNTS) and v < 0:
                    raise ImpossibleFigure(f"{at} = {v}: must be >= 0")
        if isinstance(obj.get("complete"), int) and isinstance(obj.get("requests"), int) \
                and obj["complete"] > obj["requests"]:
            raise ImpossibleFigure(f"{where}: complete = {obj['complete']} > requests = {obj['requests']}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_figures(v, f"{where}[{i}]")


class DiskFull(OSError):
    """A result that does not fit on its filesystem: nothing of it was written, the previous file is as it was."""


_held: list[tuple[str, Path]] | None = None  # (temporary file, path) of the writes a together() block holds
_owned: list[Path] = []  # folders whose other files a together() block removes at its end


@contextmanager
def together():
    """Every result written in the block lands when the block ends without an error: each is written whole to a
    temporary file beside its path at once (so a full disk fails there, naming it), and all are renamed over their
    paths at the end, one after another (microseconds). An error or a kill in the block lands none of them: the
    previous files stay as they were. Every stage runs in one (pipeline.timings.timed_stage)."""
    global _held
    if _held is not None:  # already inside one
        yield
        return
    _held = []
    try:
        yield
        for tmp, path in _held:
            os.replace(tmp, path)
        written = {path.resolve() for _, path in _held}
        for stale in (f for folder in _owned for f in folder.rglob("*") if f.is_file()):
            if stale.resolve() not in written:
                stale.unlink()
    finally:
        for tmp, _ in _held:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _held = None
        _owned.clear()


def owns(folder) -> None:
    """In a together() block: at its end, the files in `folder` (a stage's folder output) that the block did not
    write are removed, so the folder holds this run's files only (dvc.yaml keeps outputs in place across runs)."""
    if _held is None:
        raise RuntimeError("results.owns() is for a together() block (a stage's timed_stage)")
    _owned.append(Path(folder))


def _atomic(path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file beside it, renamed over it once whole (at the end of the
    together() block around it, if any). A temporary file a killed writer left there (its process gone) is removed
    first; a write the filesystem has no room for raises DiskFull naming the path and the bytes it needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.*.tmp"):
        if gone(old.name[len(path.name) + 2:].split(".")[0]):
            old.unlink(missing_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < len(data):
        raise DiskFull(full(path, len(data), free))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    held = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if _held is None:
            os.replace(tmp, path)
        else:
            _held.append((tmp, path))
            held = True
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(full(path, len(data), shutil.disk_usage(path.parent).free)) from exc
        raise
    finally:
        if not held and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def full(path: Path, needed: int, free: int) -> str:
    return (f"no room to write {path}: {needed} bytes needed, {free} free on its filesystem; the previous "
            f"{path.name} is kept as it was. Free some space (df {path.parent}) and run again.")


def write_json(path, obj) -> Path:
    check_figures(obj, Path(path).name)
    return _atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_text(path, text: str) -> Path:
    return _atomic(path, text.encode())


def write_bytes(path, data: bytes) -> Path:
    return _atomic(path, data)


def write_figure(path, fig, dpi: int) -> Path:
    """A matplotlib figure to an image file, its format from the suffix (.png)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=Path(path).suffix[1:])
    return _atomic(path, buf.getvalue())


def write_parquet(path, df, meta: dict | None = None) -> Path:
    """A DataFrame to parquet; `meta` (config, environment) rides along in the file's schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_figures(df.to_dict("records"), Path(path).name)
    table = pa.Table.from_pandas(df, preserve_index=False)
    if meta:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"lab": json.dumps(meta).encode()})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    return _atomic(path, buf.getvalue().to_pybytes())
