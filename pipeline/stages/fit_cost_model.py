"""Stage fit_cost_model: the step-time cost model fitted to every replay's steps at the configured precision level,
and one per level to the precision_policies table's steps, beside the roofline method on this CPU's measured roofs
judged on the same steps (data/results/cost_model.json)."""
import json

import pandas as pd

from pipeline.config import ROOT
from pipeline.modeling.cost_fit import fit_replays
from pipeline.modeling.machines import cpu_roofline, model_shape
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

RESULTS = ROOT / "data" / "results"
LEVELS_FROM = "precision_policies"  # the table whose points run at each precision level

if __name__ == "__main__":
    with timed_stage():
        paths = sorted((RESULTS / "engine").glob("*.json"))
        steps = pd.concat([pd.read_parquet(p.with_name(f"{p.stem}_steps.parquet")).assign(table=p.stem)
                           for p in paths], ignore_index=True)
        hw = json.loads((ROOT / "reports" / "hardware.json").read_text())
        shape = model_shape(load([]).model)
        roof = cpu_roofline(hw, shape, hw["kv_bytes_per_token"] / shape.kv_elements_per_token())
        out = fit_replays({p.stem: json.loads(p.read_text()) for p in paths}, steps, hw, LEVELS_FROM, roof)
        write_json(RESULTS / "cost_model.json", out)
        print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
