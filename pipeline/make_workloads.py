"""Stage make_workloads: every table's workloads, seeded, saved as parquet (one file per table, a `point` column)."""
import sys

import pandas as pd

from pipeline.config import ROOT, load
from pipeline.io import write_parquet
from pipeline.points import runs
from pipeline.workloads import build, tokenizer_and_vocab

OUT = ROOT / "data" / "workloads"


def main(cfg, tables: list[str]):
    tok, vocab = tokenizer_and_vocab(cfg)
    for table in tables:
        frames = []
        for name, run_cfg in runs(cfg, table):
            df = build(run_cfg, tok, vocab)
            df.insert(0, "point", name)
            frames.append(df)
        out = pd.concat(frames, ignore_index=True)
        write_parquet(OUT / f"{table}.parquet", out, {"table": table, "seed": int(cfg.seed)})
        print(f"{table}: {out['point'].nunique()} runs, {len(out)} requests")


if __name__ == "__main__":
    cfg = load([])
    main(cfg, sys.argv[1:] or list(cfg.tables))
