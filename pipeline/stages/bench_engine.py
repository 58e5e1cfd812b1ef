"""Stage bench_engine: every table of `tables` (or the tables named on the command line) in one process, each run of
a table replayed through the engine on the wall clock (data/results/engine/:
<table>.json summary rows with config and machine, <table>.parquet requests, <table>_steps.parquet steps). A run at
another precision level than the configured one (a table point's `precision`) runs on the engine at that level, loaded
once; each row names its level."""
import sys

import pandas as pd
from omegaconf import OmegaConf

from engine import threads
from pipeline.config import ROOT, load_net
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.replay import run_table, save_table
from pipeline.params import load
from pipeline.timings import timed_stage

if __name__ == "__main__":
    cfg = load([])
    threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
    nets = {cfg.precision.name: load_net(cfg)[0]}  # precision level -> the engine's model at that level

    def net_for(run_cfg):
        if run_cfg.precision.name not in nets:
            nets[run_cfg.precision.name] = load_net(run_cfg)[0]
        return nets[run_cfg.precision.name]

    for table in sys.argv[1:] or list(cfg.tables):
        with timed_stage(f"bench_engine@{table}"):
            workloads = pd.read_parquet(ROOT / "data" / "workloads" / f"{table}.parquet")
            rows, reqs, steps = run_table(net_for, cfg, table, workloads)
            meta = {"config": OmegaConf.to_container(cfg), "machine": environment(cfg.threads, cfg.precision.device)}
            save_table(ROOT / "data" / "results" / "engine", table, rows, reqs, steps, meta)
