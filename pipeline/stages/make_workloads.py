"""Stage make_workloads: every table's workloads, seeded, as parquet (data/workloads/<table>.parquet, a `point`
column naming each run)."""
import sys

from engine.config import ROOT
from pipeline.params import load
from pipeline.results import write_parquet
from pipeline.timings import timed_stage
from pipeline.workloads.generate import table_workloads, tokenizer_and_vocab

if __name__ == "__main__":
    cfg = load([])
    tok, vocab = tokenizer_and_vocab(cfg)
    for table in sys.argv[1:] or list(cfg.tables):
        with timed_stage(f"make_workloads@{table}"):
            out = table_workloads(cfg, table, tok, vocab)
            write_parquet(ROOT / "data" / "workloads" / f"{table}.parquet", out,
                          {"table": table, "seed": int(cfg.seed)})
        print(f"{table}: {out['point'].nunique()} runs, {len(out)} requests")
