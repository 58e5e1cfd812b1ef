"""Stage fit_cost_model: step time as a function of prompt tokens, decode rows and keys attended, fitted by least
squares to every per-step record of the engine replays; its error, and the knee against the ridge point.

The knee: the tokens per step at which per-token work equals the fixed per-step cost (fixed / per-token cost);
below it a step costs about the same however many tokens it carries. Prediction from the ridge (fp32 weights:
2 FLOP per weight per token over 4 bytes per weight): 2 x ridge tokens.
"""
import json

import numpy as np
import pandas as pd

from engine.simulator import FEATURES, CostModel
from pipeline.config import ROOT, load
from pipeline.io import write_json

RESULTS = ROOT / "data" / "results"


def fit(steps: pd.DataFrame) -> tuple[CostModel, dict]:
    x = np.column_stack([np.ones(len(steps)), *(steps[f].to_numpy(float) for f in FEATURES)])
    y = steps["duration"].to_numpy(float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost per token is noise, not physics
    model = CostModel(*coef)
    pred = x @ coef
    rel = np.abs(pred - y) / y
    stats = {"steps": int(len(y)), "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90)),
             "r2": float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())}
    return model, stats


def main(cfg) -> dict:
    steps = pd.concat([pd.read_parquet(p) for p in sorted((RESULTS / "engine").glob("*_steps.parquet"))],
                      ignore_index=True)
    model, stats = fit(steps[steps["duration"] > 0])
    per_token = (model.per_prompt_token + model.per_decode_row) / 2
    knee = model.fixed / per_token if per_token > 0 else float("inf")
    hw = json.loads((ROOT / "reports" / "hardware.json").read_text())
    out = {"cost_model": model.as_dict(), "fit": stats, "knee_tokens": knee,
           "ridge_flop_per_byte": hw["ridge_flop_per_byte"],
           "knee_from_ridge_tokens": hw["ridge_flop_per_byte"] * hw["weight_bytes"] / hw["params"] / 2}
    write_json(RESULTS / "cost_model.json", out)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(load())
