"""Step time as a non-negative combination of what each step computes (engine.core.simulator.FEATURES), fitted to every
per-step record of the engine replays; its error overall and per step kind, and the knee against the ridge point.

Non-negative least squares on relative error (each step weighted by 1 / its duration), so short decode steps count
as much as long prefills: a decode step's error is what TPOT and ITL are made of.
The knee: the prompt tokens per step at which their cost equals the fixed per-step cost (fixed / per prompt token);
below it a step costs about the same however many tokens it carries. Predicted from the ridge (2 FLOP per weight
per token): ridge x bytes per weight / 2 tokens (2 x ridge for fp32 weights).
The simulator's model is fitted to the steps at the configured precision level; a table whose points run at several
levels (precision_policies) also gets a model per level, fitted to its own steps at that level.
"""
import numpy as np
import pandas as pd
from scipy.optimize import nnls

from engine.core.simulator import FEATURES, CostModel


def errors(model: CostModel, steps: pd.DataFrame) -> dict:
    """Median and p90 relative error of the predicted step time, and R², over these steps."""
    y = steps["duration"].to_numpy(float)
    pred = np.array([model.predict(r) for r in steps[list(FEATURES)].to_dict("records")])
    rel = np.abs(pred - y) / y
    ss = ((y - y.mean()) ** 2).sum()
    return {"steps": int(len(y)), "median_rel_error": float(np.median(rel)),
            "p90_rel_error": float(np.percentile(rel, 90)),
            "r2": float(1 - ((y - pred) ** 2).sum() / ss) if ss else 1.0}


def fit(steps: pd.DataFrame) -> tuple[CostModel, dict]:
    """The non-negative fit; stats overall and per step kind."""
    y = steps["duration"].to_numpy(float)
    x = np.column_stack([np.ones(len(steps)), *(steps[f].to_numpy(float) for f in FEATURES)])
    w = 1.0 / y                                   # relative error
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0                       # a feature never seen: its coefficient stays 0
    coef, _ = nnls(x * w[:, None] / scale, y * w)
    coef = coef / scale
    model = CostModel(float(coef[0]), {f: float(c) for f, c in zip(FEATURES, coef[1:])})
    stats = errors(model, steps)
    stats["per_kind"] = {k: errors(model, g) for k, g in steps.groupby("kind")}
    return model, stats


def level_of(tables: dict[str, dict]) -> tuple[str, dict[tuple[str, str], str]]:
    """(the configured precision level of the replays, (table, point) -> the level the run ran at)."""
    configured = {t.get("config", {}).get("precision", {}).get("name", "fp32") for t in tables.values()}
    if len(configured) != 1:
        raise SystemExit(f"fit_cost_model: the engine results come from {len(configured)} configured precision "
                         f"levels {sorted(configured)}; rerun bench_engine at one")
    base = configured.pop()
    return base, {(name, r["point"]): r.get("precision", base) for name, t in tables.items() for r in t["rows"]}


def first_principles(roof, steps: pd.DataFrame) -> dict:
    """The roofline method (pipeline.modeling.roofline) on this CPU's measured roofs against the same measured steps
    as the fit: each step rebuilt from its record (decode rows at their recorded context, its prompt tokens split
    evenly over the prompts it samples), computed, and its errors beside the fit's (per kind too)."""
    def seconds(r) -> float:
        rows, prompts = int(r["num_decode_rows"]), max(1, int(r["num_sampled_rows"]) - int(r["num_decode_rows"]))
        ctx = int(r["decode_attention"]) // rows if rows else 0
        chunks = [(1, max(ctx - 1, 0), True)] * rows
        if r["num_prompt_tokens"]:
            chunks += [(max(1, int(r["num_prompt_tokens"]) // prompts), 0, True)] * prompts
        return roof.seconds(chunks)

    def errs(g: pd.DataFrame) -> dict:
        y = g["duration"].to_numpy(float)
        rel = np.abs(np.array([seconds(r) for r in g.to_dict("records")]) - y) / y
        return {"steps": int(len(y)), "median_rel_error": float(np.median(rel)),
                "p90_rel_error": float(np.percentile(rel, 90))}
    return {"computed": True, "bandwidth_gbs": roof.bandwidth / 1e9, "gflops": roof.rate / 1e9,
            "bytes_per_weight": roof.weight_bytes, **errs(steps),
            "per_kind": {k: errs(g) for k, g in steps.groupby("kind")}}


def fitted(model: CostModel, stats: dict) -> dict:
    per_token = model.coef["num_prompt_tokens"]
    return {"cost_model": model.as_dict(), "fit": stats,
            "knee_tokens": model.fixed / per_token if per_token > 0 else float("inf")}


def fit_replays(tables: dict[str, dict], steps: pd.DataFrame, hw: dict, levels_from: str | None = None,
                roof=None) -> dict:
    """The fit to the steps (of positive duration) of every replay not disturbed at the configured precision level,
    with the knee against the ridge point; and, where table `levels_from` ran points at several precision levels, a
    fit per level to that table's steps at the level (`levels`). `tables`: table name -> its results file (all from
    one machine); steps: their steps, with `table` and `point` columns; hw: reports/hardware.json; roof: this CPU's
    roofline (pipeline.modeling.machines.cpu_roofline), judged on the same steps as the fit (`first_principles`)."""
    machines = {t["machine"]["id"]: t["machine"] for t in tables.values()}
    if len(machines) != 1:
        raise SystemExit(f"fit_cost_model: the engine results come from {len(machines)} machines "
                         f"{[m['label'] for m in machines.values()]}; rerun bench_engine on one")
    base, levels = level_of(tables)
    disturbed = {(name, r["point"]) for name, t in tables.items() for r in t["rows"] if r.get("disturbed")}
    runs = pd.Series(list(zip(steps["table"], steps["point"])), index=steps.index)
    level = runs.map(levels)
    timed = steps["duration"] > 0
    keep = ~runs.isin(disturbed) & timed
    clean = (keep & (level == base)).sum() > len(FEATURES)  # more undisturbed steps than coefficients
    if not clean:  # a machine busy throughout: the fit to every step, said, rather than none
        print(f"fit_cost_model: fewer than {len(FEATURES) + 1} undisturbed steps at {base}; fitted to the disturbed "
              "runs too (the fit says `disturbed`)", flush=True)
        keep, disturbed = timed, set()
    model, stats = fit(steps[keep & (level == base)])
    principles = first_principles(roof, steps[keep & (level == base)]) if roof is not None else None
    stats["left_out_runs"] = sorted(f"{t} | {p}" for t, p in disturbed)
    if not clean:
        stats["disturbed"] = True  # fitted to steps timed while other work ran
    by_level = {}
    if levels_from in tables:
        for name in dict.fromkeys(r.get("precision", base) for r in tables[levels_from]["rows"]):
            mine = steps[keep & (steps["table"] == levels_from) & (level == name)]
            if len(mine) > len(FEATURES):  # more steps than coefficients
                by_level[name] = fitted(*fit(mine))
    return {**fitted(model, stats), "first_principles": principles, "precision": base, "levels": by_level,
            "levels_from": levels_from,
            "ridge_flop_per_byte": hw["ridge_flop_per_byte"],
            "knee_from_ridge_tokens": hw["ridge_flop_per_byte"] * hw["weight_bytes"] / hw["params"] / 2,
            "machine": next(iter(machines.values()))}
