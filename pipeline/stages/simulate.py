"""Stage simulate: the simulator validated against every real run, then swept, then each precision level's policies
(data/results/simulation.json)."""
import json

from engine.core.simulator import CostModel
from pipeline.config import ROOT
from pipeline.modeling.simulation import run_all
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

RESULTS = ROOT / "data" / "results"

if __name__ == "__main__":
    with timed_stage():
        fitted = json.loads((RESULTS / "cost_model.json").read_text())
        levels = {name: CostModel(**v["cost_model"]) for name, v in fitted.get("levels", {}).items()}
        out = {**run_all(CostModel(**fitted["cost_model"]), load(), levels), "machine": fitted["machine"]}
        write_json(RESULTS / "simulation.json", out)
        print(json.dumps({"validation_stats": out["validation_stats"], "timing": out["timing"]}, indent=1))
