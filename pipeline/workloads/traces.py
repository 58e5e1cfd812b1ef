"""A user's own request trace: a CSV in the Azure LLM inference trace's columns (TIMESTAMP, ContextTokens,
GeneratedTokens; further columns ignored), one request a row in arrival order. TIMESTAMP is a date-time
("2023-11-16 18:15:46.6805900") or seconds; token counts are whole numbers >= 0. A bad header or row is refused with
its line number."""
import csv
import math
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def read_trace(path) -> pd.DataFrame:
    """One row per request: arrival_s (s after the first request), input_tokens, output_tokens."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace {path}: no such file")
    with path.open(newline="") as f:
        rows = csv.reader(f)
        header = [h.strip() for h in next(rows, [])]
        if header[:3] != COLUMNS:
            raise ValueError(f"{path}, line 1: the header is {header}; a trace's first columns are {COLUMNS}")
        out = [parse_row(path, line, row) for line, row in enumerate(rows, start=2) if any(c.strip() for c in row)]
    if not out:
        raise ValueError(f"{path}: no requests after the header")
    df = pd.DataFrame(out, columns=["arrival_s", "input_tokens", "output_tokens", "line"])
    back = df[df["arrival_s"].diff() < 0]
    if len(back):
        raise ValueError(f"{path}, line {int(back['line'].iloc[0])}: TIMESTAMP goes back in time (rows must be in "
                         f"arrival order)")
    return df.assign(arrival_s=df["arrival_s"] - df["arrival_s"].iloc[0]).drop(columns="line")


def parse_row(path, line: int, row: list[str]) -> tuple[float, int, int, int]:
    """(seconds, input tokens, output tokens, line) of one CSV row, or a ValueError naming its line."""
    if len(row) < 3:
        raise ValueError(f"{path}, line {line}: {len(row)} fields, a row needs {len(COLUMNS)} ({', '.join(COLUMNS)})")
    stamp, inp, out = (c.strip() for c in row[:3])
    return seconds(path, line, stamp), count(path, line, COLUMNS[1], inp), count(path, line, COLUMNS[2], out), line


def seconds(path, line: int, stamp: str) -> float:
    """A TIMESTAMP in seconds: a number, or a date-time (UTC unless it names its zone)."""
    try:
        t = float(stamp)
    except ValueError:
        try:
            when = datetime.fromisoformat(stamp)
        except ValueError:
            raise ValueError(f"{path}, line {line}: TIMESTAMP {stamp!r} is neither seconds nor a date-time") from None
        t = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(t):
        raise ValueError(f"{path}, line {line}: TIMESTAMP {stamp!r} is not a finite time")
    return t


def count(path, line: int, column: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{path}, line {line}: {column} {text!r} is not a whole number of tokens >= 0")
    return int(text)
