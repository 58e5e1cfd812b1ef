"""Stage bench_engine: replay each run of a table through the engine on the real model, wall clock.

Writes data/results/engine/<table>.parquet (per-request records), <table>_steps.parquet (per-step records) and
<table>.json (one summary row per run, with its config and the machine's fingerprint).
"""
import sys

import pandas as pd
from omegaconf import OmegaConf

from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.points import runs
from pipeline.replay import run_one, save_table

OUT = ROOT / "data" / "results" / "engine"


def run_table(model, base, table: str) -> list[dict]:
    workloads = pd.read_parquet(ROOT / "data" / "workloads" / f"{table}.parquet")
    steps_cache: dict[int, float] = {}
    results = [run_one(model, cfg, workloads[workloads["point"] == name], table, name, steps_cache)
               for name, cfg in runs(base, table)]
    rows, reqs, steps = (list(x) for x in zip(*results))
    meta = {"config": OmegaConf.to_container(base), "machine": environment(base.threads, base.precision.device)}
    save_table(OUT, table, rows, reqs, steps, meta)
    return rows


def main(cfg, tables: list[str]):
    model, _ = load_configured_model(cfg, engine_only=True)
    for table in tables:
        run_table(model, cfg, table)


if __name__ == "__main__":
    cfg = load([])
    main(cfg, sys.argv[1:] or list(cfg.tables))
