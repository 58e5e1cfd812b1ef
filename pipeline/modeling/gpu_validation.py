"""Computed against published: every GPU run of data/published/gpu_runs.yaml computed by the real scheduler on a
virtual clock (pipeline.modeling.batch) at its GPU's spec sheet and calibrated efficiency, beside the published
figure; and the calibration itself: each efficiency term solved so that the one run its conf/hardware file
names for it (`calibrated_from`: term -> run) comes out exact. Calibration runs, and runs marked `excluded` with the
reason, are listed but never counted in the error."""
import dataclasses
import functools

import numpy as np
import yaml

from pipeline.config import ROOT, compose_config, group_entry, options
from pipeline.modeling.batch import run_batch
from pipeline.modeling.machines import spec_roofline
from pipeline.modeling.roofline import Efficiency, Roofline

PUBLISHED = ROOT / "data" / "published" / "gpu_runs.yaml"
PRECISION = "bf16-cuda"   # 16-bit weights and K/V: the published fp16 and bf16 runs alike


def figures() -> list[dict]:
    return yaml.safe_load(PUBLISHED.read_text())


@functools.lru_cache(maxsize=None)
def config(hardware: str, model: str):
    return compose_config([f"hardware={hardware}", f"model={model}", f"precision={PRECISION}"])


def computed(fig: dict, roof: Roofline) -> float:
    """The figure's metric for its batch and lengths, computed (the whole batch running at once, as it ran)."""
    b, n_in, n_out = int(fig["batch"]), int(fig["input_tokens"]), int(fig["output_tokens"])
    got = run_batch(roof, b, n_in, n_out)
    metric = fig["metric"]
    if metric == "end_to_end_latency_s":
        return got["end_to_end_s"]
    if metric in ("ttft_s", "tpot_s"):
        return got[metric]
    if metric == "prefill_tps":
        return n_in / got["ttft_s"]
    if metric == "decode_tps_per_user":
        return n_out / got["end_to_end_s"]
    if metric.startswith("output_throughput_tps"):
        return got["output_throughput_tps"] / (int(fig["gpus"]) if metric.endswith("_per_gpu") else 1)
    raise ValueError(f"{fig['id']}: unknown metric {metric!r}")


TERMS = ("matrix", "step_s", "allreduce_s", "bandwidth")            # solved in this order, in rounds
BOUNDS = {"matrix": (0.05, 1.5), "step_s": (0.0, 0.05), "allreduce_s": (0.0, 1e-3), "bandwidth": (0.05, 1.5)}
COSTS = ("step_s", "allreduce_s")                                     # terms that add time (the others divide it)


def roofline(fig: dict, eff: dict | None = None) -> Roofline:
    """The roofline of a figure's run; `eff` (Efficiency's fields) replaces the calibrated terms."""
    roof = spec_roofline(config(fig["hardware"], fig["model"]), int(fig["gpus"]))
    roof = dataclasses.replace(roof, kv_per_query_head=bool(fig.get("kv_per_query_head")))
    return dataclasses.replace(roof, eff=Efficiency(**eff)) if eff else roof


def solve(fig: dict, eff: dict, term: str) -> float:
    """The value of `term` at which `fig` comes out as published, the other terms as in `eff` (bisection: every
    metric is monotone in each term)."""
    lo, hi = BOUNDS[term]
    rises = ("_tps" in fig["metric"]) == (term not in COSTS)  # the computed figure grows with the term
    for _ in range(40):
        mid = (lo + hi) / 2
        high = computed(fig, roofline(fig, {**eff, term: mid})) > fig["value"]
        lo, hi = (lo, mid) if high == rises else (mid, hi)
    return (lo + hi) / 2


def gpu_entries() -> dict[str, dict]:
    """name -> conf/hardware entry, for every spec sheet (the measured `cpu` left out)."""
    entries = {h: group_entry("hardware", h) for h in options("hardware")}
    return {h: e for h, e in entries.items() if e["kind"] == "gpu"}


def calibration_runs(entry: dict) -> dict[str, str]:
    """term -> the published run a conf/hardware entry names to set it."""
    return {k: v for k, v in (entry["efficiency"].get("calibrated_from") or {}).items() if v}


def calibrate(rounds: int = 30) -> dict[str, dict]:
    """Every GPU's efficiency terms, each solved on the published run its conf/hardware file names for it (a run
    named by several files sets their shared term once), term by term in rounds until none moves by 1e-4 of itself; a
    GPU whose file names no run for its bandwidth takes the median of the others'. GPU -> its terms (TERMS)."""
    gpus = gpu_entries()
    eff = {h: {k: float(g["efficiency"][k]) for k in TERMS} for h, g in gpus.items()}
    figs = {f["id"]: f for f in figures()}
    for _ in range(rounds):
        moved = 0.0
        for term in TERMS:
            named: dict[str, list[str]] = {}
            for h, g in gpus.items():
                if term in calibration_runs(g):
                    named.setdefault(calibration_runs(g)[term], []).append(h)
            for run_id, hs in named.items():
                if run_id not in figs:
                    raise ValueError(f"conf/hardware/{hs[0]}.yaml: calibrated_from.{term} {run_id!r} is not a run of "
                                     f"{PUBLISHED.name}")
                value = solve(figs[run_id], eff[figs[run_id]["hardware"]], term)
                for h in hs:
                    moved = max(moved, abs(eff[h][term] - value) / max(abs(value), 1e-12))
                    eff[h][term] = value
        own = [eff[h]["bandwidth"] for h, g in gpus.items() if "bandwidth" in calibration_runs(g)]
        for h, g in gpus.items():
            if "bandwidth" not in calibration_runs(g):
                eff[h]["bandwidth"] = float(np.median(own))
        if moved < 1e-4:
            break
    return {h: {"bandwidth": round(e["bandwidth"], 4), "matrix": round(e["matrix"], 4),
                "step_s": round(e["step_s"], 6), "allreduce_s": round(e["allreduce_s"], 7)} for h, e in eff.items()}


def validate() -> dict:
    """Every published run computed: a row each (calibration runs marked), and the error over the others."""
    hardware = gpu_entries()
    calibration = {run_id for entry in hardware.values() for run_id in calibration_runs(entry).values()}
    rows = []
    for fig in figures():
        value = computed(fig, roofline(fig))
        rows.append({**{k: fig[k] for k in ("id", "source", "engine", "hardware", "gpus", "published_model", "model",
                                            "precision", "batch", "input_tokens", "output_tokens", "metric")},
                     "kv_per_query_head": bool(fig.get("kv_per_query_head")),
                     "published": fig["value"], "computed": value, "rel_error": value / fig["value"] - 1,
                     "calibration": fig["id"] in calibration, "excluded": fig.get("excluded")})
    counted = [r for r in rows if not r["calibration"] and not r["excluded"]]
    used = {r["source"] for r in rows if r["calibration"]}
    err = np.abs([r["rel_error"] for r in counted])
    return {"computed": True, "precision": PRECISION, "figures": rows,
            "stats": {"figures": len(counted), "sources": len({r["source"] for r in counted}),
                      "figures_from_sources_not_calibrating": sum(r["source"] not in used for r in counted),
                      "sources_not_calibrating": len({r["source"] for r in counted} - used),
                      "excluded_figures": sum(bool(r["excluded"]) for r in rows),
                      "median_abs_rel_error": float(np.median(err)), "max_abs_rel_error": float(err.max()),
                      "over_35_percent": int((err > 0.35).sum()),
                      "calibration_figures": sum(r["calibration"] for r in rows)},
            "hardware": hardware}
