"""Stage bench_engine: replay each run of a table through the engine on the real model, wall clock.

Writes data/results/engine/<table>.parquet (per-request records), <table>_steps.parquet (per-step records) and
<table>.json (one summary row per run, with its config and environment).
"""
import sys

import pandas as pd
import torch
from omegaconf import OmegaConf

from engine import LLMEngine
from engine.loader import eos_ids
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.io import write_json, write_parquet
from pipeline.metrics import summarize
from pipeline.points import runs
from pipeline.replay import calibrate_step, replay
from pipeline.workloads import predicted_static_efficiency

OUT = ROOT / "data" / "results" / "engine"


def slo_limits(slo, step_s: float) -> tuple[float, float]:
    """(TTFT, TPOT) limits in seconds: absolute, or multiples of the measured full-batch decode step."""
    if "ttft_s" in slo:
        return float(slo.ttft_s), float(slo.tpot_s)
    return float(slo.ttft_steps) * step_s, float(slo.tpot_steps) * step_s


def run_one(model, cfg, wl: pd.DataFrame, table: str, name: str, steps_cache: dict[int, float]):
    """Replay one run's workload; returns (summary row, per-request records, per-step records)."""
    ref, eos = int(cfg.load.get("ref_seats", cfg.policy.max_seats)), eos_ids(model)
    if ref not in steps_cache:
        steps_cache[ref] = calibrate_step(model, ref, int(cfg.seat_tokens), int(wl["prompt_tokens"].median()), eos=eos)
    step_s = steps_cache[ref]
    engine = LLMEngine(model, OmegaConf.to_container(cfg.policy), int(cfg.seat_tokens), eos, seed=int(cfg.seed))
    conc = int(cfg.load.concurrency) if cfg.load.process == "closed" else None
    req, st, _ = replay(engine, wl, step_s, conc)
    ttft_lim, tpot_lim = slo_limits(cfg.slo, step_s)
    row = {"table": table, "point": name, "policy": cfg.policy.name, "workload": cfg.workload.name,
           "load": cfg.load.name, "load_multiple": float(cfg.load.get("multiple", float("nan"))),
           "sigma": float(cfg.workload.output.sigma),
           "length_cv": float(wl["output_tokens"].std(ddof=0) / wl["output_tokens"].mean()), "step_s": step_s,
           "ttft_limit_s": ttft_lim, "tpot_limit_s": tpot_lim, **summarize(req, st, ttft_lim, tpot_lim)}
    if cfg.policy.name in ("static", "dynamic", "bucketed"):
        row["batch_sizes"] = list(engine.scheduler.batch_sizes)
        row["predicted_static_efficiency"] = predicted_static_efficiency(
            wl.sort_values("arrival_steps")["output_tokens"], int(cfg.policy.max_batch))
    for knob in ("max_wait_ms", "token_budget", "max_batch", "max_seats"):
        if knob in cfg.policy:
            row[knob] = float(cfg.policy[knob])
    print(f"{table} | {name}: {row['throughput_tps']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s, "
          f"{row['complete']}/{row['requests']} complete", flush=True)
    return row, req.assign(point=name), st.assign(point=name)


def save_table(out_dir, table: str, rows: list[dict], reqs: list, steps: list, meta: dict):
    """<table>.json (summary rows + meta), <table>.parquet (requests), <table>_steps.parquet (steps)."""
    write_parquet(out_dir / f"{table}.parquet", pd.concat(reqs, ignore_index=True), meta)
    write_parquet(out_dir / f"{table}_steps.parquet", pd.concat(steps, ignore_index=True), meta)
    write_json(out_dir / f"{table}.json", {"rows": rows, **meta})


def run_table(model, base, table: str) -> list[dict]:
    workloads = pd.read_parquet(ROOT / "data" / "workloads" / f"{table}.parquet")
    steps_cache: dict[int, float] = {}
    results = [run_one(model, cfg, workloads[workloads["point"] == name], table, name, steps_cache)
               for name, cfg in runs(base, table)]
    rows, reqs, steps = (list(x) for x in zip(*results))
    meta = {"config": OmegaConf.to_container(base), "environment": environment(base.precision.device)}
    save_table(OUT, table, rows, reqs, steps, meta)
    return rows


def main(cfg, tables: list[str]):
    model, _ = load_configured_model(cfg)
    for table in tables:
        run_table(model, cfg, table)


if __name__ == "__main__":
    cfg = load([])
    main(cfg, sys.argv[1:] or list(cfg.tables))
