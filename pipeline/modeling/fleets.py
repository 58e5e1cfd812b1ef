"""The fleet report's figures (stage compute_fleet, params' `fleet`), computed on a spec sheet: every router over the
same replicas on each workload; prefill and decode apart against colocated at equal GPUs; the planner's GPUs against
the request rate."""
from engine.router import POLICIES
from pipeline.modeling.planner import Fleet, Setting, capacity, fleet_config, grid, plan, replica_guess


def setting(spec: dict, workload: str) -> Setting:
    """The fleet entry's model on its GPU, on one workload."""
    cfg = fleet_config([f"hardware={spec['hardware']}", f"model={spec['model']}", f"precision={spec['precision']}",
                        f"workload={workload}", f"seed={spec['seed']}"], int(spec["requests"]))
    return Setting(cfg, spec.get("tp"), float(spec["split"]["latency_s"]), seconds=float(spec["seconds"]))


def routers(spec: dict) -> list[dict]:
    """Each router over `replicas` colocated replicas, per workload at `multiple` x the fleet's 16-row decode rate."""
    part, rows = spec["routers"], []
    for workload, multiples in part["workloads"].items():
        s = setting(spec, workload)
        for multiple in multiples:
            rate = float(multiple) * int(part["replicas"]) * replica_guess(s)
            for name in POLICIES:
                row = s.simulate(rate, Fleet(int(part["replicas"]), name))
                rows.append({"workload": workload, "multiple": float(multiple), "rate": rate, **row})
    return rows


def splits(spec: dict) -> list[dict]:
    """Per workload: the highest rate each layout of `gpus` GPUs serves within the SLO (goodput per GPU as DistServe
    defines it: that rate over the GPUs), colocated and each prefill share of `shares`."""
    part, rows = spec["split"], []
    for workload in part["workloads"]:
        s = setting(spec, workload)
        for share in [None, *part["shares"]]:
            fleet = Fleet(int(part["gpus"]) // s.roof.tp, "least_loaded", share)
            rate, row = capacity(s, fleet)
            row = row or {}
            rows.append({"workload": workload, "layout": row.get("split", fleet.layout), "gpus": s.gpus(fleet),
                         "capacity_rps": rate, "goodput_per_gpu_rps": rate / s.gpus(fleet),
                         **{k: row.get(k) for k in ("requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                                    "tpot_p99_s")}})
    return rows


def planned(spec: dict, s: Setting) -> dict:
    """The planner on `plan.workload` (setting s) at each of `plan.rates`, each best fleet simulated again with the
    next seed."""
    part = spec["plan"]
    fleets = grid(list(part["routers"]), list(part["splits"]), list(part["max_running"]), list(part["budgets"]))
    return {"workload": part["workload"], "usd_per_gpu_hour": float(part["usd_per_gpu_hour"]),
            "check_seed": int(spec["seed"]) + 1,
            "plans": plan(s, sorted(float(r) for r in part["rates"]), fleets, float(part["usd_per_gpu_hour"]))}


def compute(spec: dict) -> dict:
    """Every section of the fleet report; spec: params' `fleet` with `seed` added."""
    s = setting(spec, spec["plan"]["workload"])
    return {"computed": True, "hardware": s.cfg.hardware.name, "hardware_label": s.cfg.hardware.label,
            "model": s.cfg.model.name, "precision": s.cfg.precision.name, "tp": s.roof.tp,
            "requests": int(spec["requests"]), "seconds": float(spec["seconds"]), "seed": int(spec["seed"]),
            "slo": dict(s.cfg.slo), "kv_tokens_per_replica": s.kv_tokens, "link_gbs": s.link_bytes_s / 1e9,
            "latency_s": s.latency_s, "routers": routers(spec), "splits": splits(spec), "plan": planned(spec, s)}
