"""Stage compute_fleet: params' `fleet` (a model on a GPU's spec sheet) as fleets, computed by the real engine on the
roofline (reports/fleet/: FLEET.md, fleet.json, plots/): routers over the same replicas, prefill and decode apart
against colocated, the planner's fewest GPUs against the request rate."""
from omegaconf import OmegaConf

from pipeline.config import ROOT
from pipeline.modeling.fleets import compute
from pipeline.params import load
from pipeline.reporting.fleet import report
from pipeline.results import owns, write_json, write_text
from pipeline.timings import timed_stage

if __name__ == "__main__":
    cfg = load([])
    with timed_stage():
        out = compute({**OmegaConf.to_container(cfg.fleet), "seed": int(cfg.seed)})
        folder = ROOT / "reports" / "fleet"
        owns(folder)
        write_json(folder / "fleet.json", out)
        write_text(folder / "FLEET.md", report(out, folder / "plots"))
        print(f"compute_fleet: {folder / 'FLEET.md'}")
