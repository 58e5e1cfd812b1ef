"""Result writes: a file appears whole or not at all (a half-written result never replaces a good one), and never
with an impossible figure: a negative or non-finite rate, a negative time, size or count, a part that exceeds its
whole (complete > requests) is refused, naming the file and the field's path."""
import json
import math
import os
import tempfile
from pathlib import Path

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


def _atomic(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json(path, obj) -> Path:
    check_figures(obj, Path(path).name)

    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
    return _atomic(path, w)


def write_text(path, text: str) -> Path:
    return _atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_bytes(path, data: bytes) -> Path:
    return _atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def write_parquet(path, df, meta: dict | None = None) -> Path:
    """A DataFrame to parquet; `meta` (config, environment) rides along in the file's schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_figures(df.to_dict("records"), Path(path).name)
    table = pa.Table.from_pandas(df, preserve_index=False)
    if meta:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"lab": json.dumps(meta).encode()})
    return _atomic(path, lambda tmp: pq.write_table(table, tmp))
