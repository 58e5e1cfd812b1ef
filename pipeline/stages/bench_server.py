"""Stage bench_server: every server under closed-loop load at each concurrency, the main workload open loop, and the
in-process references (data/results/server/, reports/SCOREBOARD.md)."""
import json

import pandas as pd
from omegaconf import OmegaConf

from pipeline.config import ROOT
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.servers import run_servers
from pipeline.params import load
from pipeline.reporting.scoreboard import scoreboard
from pipeline.results import write_json, write_parquet, write_text
from pipeline.timings import timed_stage

OUT = ROOT / "data" / "results" / "server"

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        rows, recs, ref, opened, open_recs = run_servers(cfg)
        env = environment(cfg.threads, cfg.precision.device)
        meta = {"machine": env, "bench": OmegaConf.to_container(cfg.bench.server)}
        write_parquet(OUT / "servers.parquet", pd.concat(recs, ignore_index=True).drop(columns=["error"]), meta)
        write_parquet(OUT / "open_loop.parquet", open_recs, meta)
        write_json(OUT / "servers.json", {"rows": rows, "reference_c64": ref, "open_loop": opened, "machine": env})
        prec = ROOT / "reports" / "precision.json"
        write_text(ROOT / "reports" / "SCOREBOARD.md",
                   scoreboard(rows, env, ref, opened, json.loads(prec.read_text()) if prec.exists() else None))
