"""Stage make_workloads [table ...]: every table's workloads (or the tables named), seeded, as parquet
(data/workloads/<table>.parquet, a `point` column naming each run; the file's metadata names each production-shaped
run's workload: its lengths' label ("Azure conv lengths / 8"), source, scale, arrivals and burstiness k)."""
import sys

from pipeline.config import ROOT
from pipeline.params import load
from pipeline.results import owns, write_parquet
from pipeline.timings import timed_stage
from pipeline.workloads.generate import table_workloads, tokenizer_and_vocab
from pipeline.workloads.runs import runs


def labelled(cfg, table: str, attrs: dict) -> dict:
    """The frame's attrs with each shaped run's arrivals (load.process) and gamma burstiness k (None: not gamma)."""
    shaped = dict(attrs.get("workloads", {}))
    for name, run_cfg in runs(cfg, table) if shaped else ():
        if name in shaped:
            shaped[name] = {**shaped[name], "arrivals": str(run_cfg.load.process),
                            "burstiness": run_cfg.load.get("burstiness")}
    return {"workloads": shaped} if shaped else {}


if __name__ == "__main__":
    with timed_stage("make_workloads"):
        cfg = load([])
        tok, vocab = tokenizer_and_vocab(cfg)
        if not sys.argv[1:]:
            owns(ROOT / "data" / "workloads")
        for table in sys.argv[1:] or list(cfg.tables):
            out = table_workloads(cfg, table, tok, vocab)
            write_parquet(ROOT / "data" / "workloads" / f"{table}.parquet", out,
                          {"table": table, "seed": int(cfg.seed), **labelled(cfg, table, out.attrs)})
            print(f"{table}: {out['point'].nunique()} runs, {len(out)} requests")
