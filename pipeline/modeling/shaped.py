"""Production-shaped traffic: every policy of conf/experiment/shaped.yaml on shaped workloads (conf/workload/ with
`lengths`) under gamma arrivals of burstiness k (bench.shaped).

1. Simulated sweep: every `simulated` workload x k x policy x load multiple (x full-batch decode capacity,
   pipeline.workloads.arrivals.step_rate), each load also as a rate in requests/s at the predicted full-batch step;
   capacity at the SLO per workload, k and policy (pipeline.measuring.metrics.capacity_at_slo).
2. The load near capacity: `near` x the capacity at the SLO of the `reference` policy at k = 1, as a load multiple,
   per workload; every cell simulated there.
3. Measured: every `measured` workload x k x policy replayed on the engine at that load (the same workload and
   arrivals for every policy of a cell); each also simulated on its own workload and measured step, and the simulator
   judged against the measured runs (agreement).
"""
import copy
import time

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from scipy.stats import spearmanr

from engine.core.simulator import CostModel
from pipeline.measuring.metrics import capacity_at_slo, slo_limits
from pipeline.measuring.replay import run_one
from pipeline.modeling.simulation import full_batch_decode, simulate
from pipeline.workloads.arrivals import step_rate
from pipeline.workloads.generate import build
from pipeline.workloads.runs import point_overrides, table_config
from pipeline.workloads.shapes import label

TABLE = "shaped"
VALIDATED = ("throughput_tps", "ttft_p99_s")  # the metrics the simulator is judged on
KEPT = ("throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s", "preemptions",
        "slo_met", "complete", "requests")  # summary fields kept per run
CELL = ("workload", "burstiness")  # what makes one cell of the grid


def policies(base) -> list[str]:
    """The policies of the shaped experiment, in its order."""
    return [str(p["policy"]) for p in point_overrides(table_config(base, TABLE).table)]


def configs(base, workload: str, num_requests: int) -> dict:
    """policy -> its composed config on `workload` with `num_requests` (x profile.requests_scale), measured under
    the base's `measure` settings."""
    out = {p: table_config(base, TABLE, {"policy": p, "workload": workload, "workload.num_requests": num_requests})
           for p in policies(base)}
    for c in out.values():
        c.measure = copy.deepcopy(base.measure)
    return out


def at_load(cfgs: dict, k: float, multiple: float):
    """Every config of `cfgs` (policy -> config) set, in place, to gamma arrivals of burstiness k at `multiple` x
    capacity; the first of them (whose workload every policy runs)."""
    for c in cfgs.values():
        c.load.burstiness, c.load.multiple = float(k), float(multiple)
    return next(iter(cfgs.values()))


def rate_rps(cfg, wl: pd.DataFrame, step_s: float) -> float:
    """The workload's mean arrival rate in requests/s when its full-batch step takes step_s."""
    return step_rate(cfg.load, float(wl["output_tokens"].mean())) / step_s


def simulated(cost: CostModel, cfg, wl: pd.DataFrame, step_s: float) -> dict:
    """One run in simulation at full-batch step step_s: KEPT fields, its limits and its rate."""
    ttft, tpot = slo_limits(cfg.slo, step_s)
    got = simulate(cost, OmegaConf.to_container(cfg.policy), wl, step_s, int(cfg.max_request_tokens), ttft, tpot,
                   kv=OmegaConf.to_container(cfg.kv))
    return {**{k: got.get(k) for k in KEPT}, "ttft_limit_s": ttft, "tpot_limit_s": tpot,
            "rate_rps": rate_rps(cfg, wl, step_s)}


def point(cfg, workload: str, k: float, multiple: float, policy: str) -> dict:
    return {"workload": workload, "lengths": label(cfg.workload), "burstiness": float(k), "multiple": float(multiple),
            "policy": policy}


def sweep(cost: CostModel, composed: dict, spec, step_s: float) -> list[dict]:
    """Every simulated workload x k x policy x load multiple (spec: bench.shaped.simulated; composed: workload ->
    configs())."""
    rows = []
    for workload in spec.workloads:
        cfgs = composed[workload]
        for k in spec.burstiness:
            for m in spec.multiples:
                wl = build(at_load(cfgs, k, m), None, 50000)  # one workload for every policy
                rows += [{**point(c, workload, k, m, p), **simulated(cost, c, wl, step_s)} for p, c in cfgs.items()]
    return rows


def capacities(rows: list[dict]) -> list[dict]:
    """Capacity at the SLO per workload, k and policy from the sweep's rows: requests/s and load multiple."""
    df = pd.DataFrame(rows)
    out = []
    for (workload, k, policy), g in df.groupby(["workload", "burstiness", "policy"], sort=False):
        recs = g.to_dict("records")
        ttft, tpot = recs[0]["ttft_limit_s"], recs[0]["tpot_limit_s"]
        out.append({"workload": workload, "lengths": recs[0]["lengths"], "burstiness": k, "policy": policy,
                    "capacity_rps": capacity_at_slo(recs, ttft, tpot),
                    "capacity_multiple": capacity_at_slo(recs, ttft, tpot, "multiple"),
                    "ttft_limit_s": ttft, "tpot_limit_s": tpot})
    return out


def near_capacity(caps: list[dict], spec, multiples) -> dict[str, float]:
    """workload -> the load multiple near capacity: `near` x the reference policy's capacity at k = 1 (the smallest
    simulated multiple where it meets the SLO at no simulated load)."""
    out = {}
    for c in caps:
        if c["policy"] == spec.reference and c["burstiness"] == 1.0:
            out[c["workload"]] = float(spec.near) * c["capacity_multiple"] or float(min(multiples))
    return out


def at_near(cost: CostModel, composed: dict, spec, step_s: float, loads: dict[str, float]) -> list[dict]:
    """Every simulated workload x k x policy at its load near capacity (composed: workload -> configs())."""
    rows = []
    for workload in spec.simulated.workloads:
        cfgs, m = composed[workload], loads[workload]
        for k in spec.simulated.burstiness:
            wl = build(at_load(cfgs, k, m), None, 50000)
            rows += [{**point(c, workload, k, m, p), **simulated(cost, c, wl, step_s)} for p, c in cfgs.items()]
    return rows


def measure(net_tok_vocab, cost: CostModel, base, spec, loads: dict[str, float]) -> list[dict]:
    """Every measured workload x k x policy replayed on the engine at its load near capacity, each beside its own
    simulation (sim_ fields) on the same workload at the measured full-batch step."""
    net, tok, vocab = net_tok_vocab
    steps_cache: dict[tuple, float] = {}
    rows = []
    for workload in spec.measured.workloads:
        cfgs = configs(base, workload, int(spec.measured.num_requests))
        m = loads[workload]
        for k in spec.measured.burstiness:
            wl = build(at_load(cfgs, k, m), tok, vocab)
            for p, cfg in cfgs.items():
                row, _, _ = run_one(net, cfg, wl, TABLE, f"workload={workload} load.burstiness={k:g} policy={p}",
                                    steps_cache)
                sim = simulated(cost, cfg, wl, row["step_s"])
                rows.append({**point(cfg, workload, k, m, p), **{f: row.get(f) for f in KEPT},
                             "step_s": row["step_s"], "ttft_limit_s": row["ttft_limit_s"],
                             "tpot_limit_s": row["tpot_limit_s"], "rate_rps": rate_rps(cfg, wl, row["step_s"]),
                             "disturbed": bool(row.get("disturbed")), "clipped": int(wl["clipped"].sum()),
                             **{f"sim_{f}": sim[f] for f in KEPT}})
    return rows


def agreement(pairs: pd.DataFrame, metrics=VALIDATED, cell=CELL, disturbed_too: bool = False) -> dict:
    """Per metric, over the runs not disturbed (every run with disturbed_too): the Spearman rank correlation of
    measured (`<m>`) against simulated (`sim_<m>`) over those runs, its median over the cells (the policies' order
    within each; cells of fewer than 3 runs or constant figures left out), and the median relative error of the
    simulated figure."""
    ok = pairs[~pairs["disturbed"]] if "disturbed" in pairs and not disturbed_too else pairs
    out = {}
    for m in metrics:
        d = ok[[*cell, m, f"sim_{m}"]].dropna()
        within = [spearmanr(g[m], g[f"sim_{m}"]).statistic for _, g in d.groupby(list(cell))
                  if len(g) > 2 and g[m].nunique() > 1 and g[f"sim_{m}"].nunique() > 1]
        out[m] = {"spearman": float(spearmanr(d[m], d[f"sim_{m}"]).statistic) if len(d) > 2 else float("nan"),
                  "spearman_within_cells_median": float(np.median(within)) if within else float("nan"),
                  "median_rel_error": float(np.median(np.abs(d[f"sim_{m}"] / d[m] - 1))) if len(d) else float("nan"),
                  "runs": int(len(d))}
    return out


def run(net_tok_vocab, cost: CostModel, base) -> dict:
    """The whole of it (see the module): sweep, capacities, loads near capacity, the cells simulated there, the
    measured runs and the simulator's agreement with them."""
    spec = base.bench.shaped
    if 1.0 not in [float(k) for k in spec.simulated.burstiness] or not set(spec.measured.workloads) <= set(
            spec.simulated.workloads):
        raise ValueError("bench.shaped: the simulated cells must hold k = 1 and every measured workload (the load "
                         "near capacity comes from them)")
    step_s = cost.step_time(full_batch_decode(int(base.load.ref_seats), 64))  # the full-batch step it predicts
    t = time.perf_counter()
    composed = {w: configs(base, w, int(spec.simulated.num_requests)) for w in spec.simulated.workloads}
    swept = sweep(cost, composed, spec.simulated, step_s)
    caps = capacities(swept)
    loads = near_capacity(caps, spec, spec.simulated.multiples)
    near = at_near(cost, composed, spec, step_s, loads)
    simulated_s, t = time.perf_counter() - t, time.perf_counter()
    measured = measure(net_tok_vocab, cost, base, spec, loads)
    return {"lengths": {r["workload"]: r["lengths"] for r in swept},
            "reference": str(spec.reference), "near": float(spec.near), "loads": loads, "step_s": step_s,
            "sweep": swept, "capacities": caps, "at_load": near, "measured": measured,
            "agreement": agreement(pd.DataFrame(measured)),
            "timing": {"simulated_s": simulated_s, "simulated_runs": len(swept) + len(near),
                       "measured_s": time.perf_counter() - t, "measured_runs": len(measured)}}
