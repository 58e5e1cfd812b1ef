"""The real scheduler on a virtual clock driven by the fitted cost model.

1. Validation: every real engine run replayed in simulation on the same workload; Spearman rank correlation and
   median relative error of throughput, TTFT p50 and TPOT p50.
2. Sweeps (median of 3 seeds): load 0.2 to 2.0, output-length sigma (of log-length) 0 to 1, and max_running 2 to
   64 (the KV reserved and the fraction of it left unused); the load sweep gives each policy's goodput knee.
3. Precision levels: each level's own cost model (fit_cost_model's `levels`) driving the headline policies, so how
   much continuous gains over static at each level, simulated beside the measured rows.
"""
import json
import time

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from scipy.stats import spearmanr

from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.core.simulator import CostModel, SimRunner, VirtualClock
from engine.factory import build_engine
from pipeline.config import ROOT, kv_spec, policy_spec
from pipeline.measuring.metrics import slo_limits, summarize
from pipeline.measuring.replay import replay
from pipeline.workloads.generate import build
from pipeline.workloads.runs import table_config

RESULTS = ROOT / "data" / "results"
METRICS = ["throughput_tps", "ttft_p50_s", "tpot_p50_s"]


def simulate(cost: CostModel, policy: dict, workload: pd.DataFrame, step_s: float, max_request_tokens: int,
             ttft_limit: float, tpot_limit: float, concurrency=None, kv="slot") -> dict:
    """One run in simulation: the workload replayed through the real scheduler on SimRunner; its summary row.
    kv: a conf/kv entry; a paged pool is sized by kv.num_blocks (or the slot cache's size)."""
    clock = VirtualClock()
    eng = build_engine(None, policy_spec(policy), max_request_tokens, runner=SimRunner(cost, clock), clock=clock,
                       kv=kv_spec(kv))
    req, steps, _ = replay(eng, workload, step_s, concurrency, time_limit_s=1e6,
                           wait_until=lambda t: clock.advance_to(eng.t0 + t))
    return summarize(req, steps, ttft_limit, tpot_limit)


def full_batch_decode(seats: int, context: int) -> SchedulerOutput:
    """A step of `seats` decodes at `context` tokens each, in seats 0..seats-1."""
    return SchedulerOutput(tuple(ScheduledChunk(f"d{i}", context - 1, (0,), sample=True, seat=i) for i in range(seats)))


def validate(cost: CostModel, base, levels: dict[str, CostModel] | None = None) -> tuple[list[dict], dict]:
    """Every real run replayed in simulation: a row each (disturbed runs marked), and per metric the Spearman rank
    correlation and median relative error over the runs not disturbed. A run at another precision level than the
    configured one is simulated with that level's model (`levels`), or left out where the level has none."""
    rows = []
    for path in sorted((RESULTS / "engine").glob("*.json")):
        table = path.stem
        workloads = pd.read_parquet(ROOT / "data" / "workloads" / f"{table}.parquet")
        for real in json.loads(path.read_text())["rows"]:
            level = real.get("precision", base.precision.name)
            model = cost if level == base.precision.name else (levels or {}).get(level)
            if model is None:
                continue
            cfg = table_config(base, table, dict(kv.split("=", 1) for kv in real["point"].split()) if
                               real["point"] not in ("main", "default") else None)
            wl = workloads[workloads["point"] == real["point"]]
            sim = simulate(model, OmegaConf.to_container(cfg.policy), wl, real["step_s"], int(cfg.max_request_tokens),
                           real["ttft_limit_s"], real["tpot_limit_s"], real.get("concurrency"),
                           kv=OmegaConf.to_container(cfg.kv))
            rows.append({"table": table, "point": real["point"], "policy": real["policy"], "precision": level,
                         "disturbed": bool(real.get("disturbed")),
                         **{f"real_{m}": real[m] for m in METRICS}, **{f"sim_{m}": sim[m] for m in METRICS}})
    df = pd.DataFrame(rows)
    df = df[~df["disturbed"]]
    stats = {}
    for m in METRICS:
        ok = df[[f"real_{m}", f"sim_{m}"]].dropna()
        stats[m] = {"spearman": float(spearmanr(ok[f"real_{m}"], ok[f"sim_{m}"]).statistic),
                    "median_rel_error": float(np.median(np.abs(ok[f"sim_{m}"] / ok[f"real_{m}"] - 1)))}
    return rows, stats


def sweep(cost: CostModel, base, step_s: float, axis: str, values, policies, seeds=(0, 1, 2)) -> list[dict]:
    """Median over seeds of each policy at each value of one axis (a key of the composed config, set as an override
    would set it: a key it does not have fails)."""
    out = []
    composed = {name: table_config(base, "all_policies", {"policy": name}) for name in policies}
    for v in values:
        for name in policies:
            runs = []
            cfg = composed[name]
            OmegaConf.update(cfg, axis, v, merge=False)
            for seed in seeds:
                cfg.seed = seed
                wl = build(cfg, None, 50000)
                ttft, tpot = slo_limits(cfg.slo, step_s)
                runs.append(simulate(cost, OmegaConf.to_container(cfg.policy), wl, step_s, int(cfg.max_request_tokens),
                                     ttft, tpot, kv=OmegaConf.to_container(cfg.kv)))
            med = {k: float(np.median([r[k] for r in runs])) for k in
                   ("throughput_tps", "goodput_tps", "ttft_p99_s", "ttft_p50_s", "tpot_p50_s", "slot_efficiency",
                    "kv_unused")}
            out.append({"axis": axis, "value": v, "policy": name, **med, "seats": int(cfg.policy.max_running),
                        "reserved_tokens_per_seat": int(cfg.max_request_tokens)})
    return out


def level_gains(levels: dict[str, CostModel], base, table: str = "precision_policies",
                policies=("static", "dynamic", "continuous", "chunked"), seeds=(0, 1, 2)) -> list[dict]:
    """Each precision level's cost model driving `table`'s policies (median over seeds), each level at the load and
    SLOs of its own predicted full-batch step; with the decode step it predicts at one row and at ref_seats rows."""
    out = []
    for level, cost in levels.items():
        seats = int(base.load.ref_seats)
        step_s = cost.step_time(full_batch_decode(seats, 64))
        for name in policies:
            cfg = table_config(base, table, {"policy": name})
            runs = []
            for seed in seeds:
                cfg.seed = seed
                ttft, tpot = slo_limits(cfg.slo, step_s)
                runs.append(simulate(cost, OmegaConf.to_container(cfg.policy), build(cfg, None, 50000), step_s,
                                     int(cfg.max_request_tokens), ttft, tpot, kv=OmegaConf.to_container(cfg.kv)))
            out.append({"precision": level, "policy": name, "step_s": step_s, "seats": seats,
                        "decode_one_row_s": cost.step_time(full_batch_decode(1, 64)),
                        **{k: float(np.median([r[k] for r in runs])) for k in
                           ("throughput_tps", "goodput_tps", "ttft_p99_s", "tpot_p50_s")}})
    return out


def run_all(cost: CostModel, base, levels: dict[str, CostModel] | None = None) -> dict:
    """Validation against every real run, then the sweeps, then each precision level's policies (`levels`: level ->
    its cost model); with their timings."""
    step_s = cost.step_time(full_batch_decode(int(base.load.ref_seats), 64))  # the full-batch step it predicts
    t = time.perf_counter()
    rows, stats = validate(cost, base, levels)
    validation_s = time.perf_counter() - t
    t = time.perf_counter()
    policies = ["static", "dynamic", "continuous", "chunked"]
    loads = [round(float(x), 1) for x in np.arange(0.2, 2.01, 0.2)]  # Python floats: a config holds no numpy value
    sweeps = (sweep(cost, base, step_s, "load.multiple", loads, policies)
              + sweep(cost, base, step_s, "workload.output.sigma", [0.0, 0.25, 0.5, 0.75, 1.0], policies)
              + sweep(cost, base, step_s, "policy.max_running", [2, 4, 8, 16, 32, 64], ["continuous", "chunked"]))
    sweep_s = time.perf_counter() - t
    points = len(sweeps) * 3
    return {"validation": rows, "validation_stats": stats, "sweeps": sweeps, "step_s": step_s,
            "levels": level_gains(levels or {}, base),
            "timing": {"validation_s": validation_s, "sweep_s": sweep_s, "sweep_points": points,
                       "points_per_s": points / sweep_s}}


