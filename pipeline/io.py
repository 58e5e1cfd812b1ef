"""Atomic result writes: a file appears whole or not at all, so a half-written result never replaces a good one."""
import json
import os
import tempfile
from pathlib import Path


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

    table = pa.Table.from_pandas(df, preserve_index=False)
    if meta:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"lab": json.dumps(meta).encode()})
    return _atomic(path, lambda tmp: pq.write_table(table, tmp))
