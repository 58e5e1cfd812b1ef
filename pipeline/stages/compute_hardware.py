"""Stage compute_hardware <name>: the seed tables at GPU scale for params' `computed.<name>` (a hardware, model and
precision), computed by the real scheduler on the spec sheet's roofline (reports/hardware/<name>/: REPORT.md,
computed.json, plots/)."""
import json
import sys

from omegaconf import OmegaConf

from pipeline.config import ROOT
from pipeline.modeling.computed import compute
from pipeline.params import load
from pipeline.reporting.computed import report
from pipeline.results import owns, write_json, write_text
from pipeline.timings import timed_stage

if __name__ == "__main__":
    cfg = load([])
    for name in sys.argv[1:] or list(cfg.computed):
        if name not in cfg.computed:
            raise SystemExit(f"compute_hardware: no computed entry {name!r}; params have {sorted(cfg.computed)}")
        with timed_stage(f"compute_hardware@{name}"):
            out = compute(OmegaConf.to_container(cfg.computed[name]), int(cfg.seed))
            folder = ROOT / "reports" / "hardware" / name
            owns(folder)
            validation = ROOT / "reports" / "gpu_validation.json"
            write_json(folder / "computed.json", out)
            write_text(folder / "REPORT.md", report(out, json.loads(validation.read_text()) if validation.exists()
                                                    else None, folder / "plots"))
            print(f"compute_hardware@{name}: {folder / 'REPORT.md'}")
