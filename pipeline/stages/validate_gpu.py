"""Stage validate_gpu: every published GPU run of data/published/gpu_runs.yaml computed at its GPU's spec sheet,
beside the published figure (reports/gpu_validation.md and .json; calibration runs marked, not counted)."""
import json

from pipeline.config import ROOT
from pipeline.modeling.gpu_validation import validate
from pipeline.reporting.computed import validation_report
from pipeline.results import write_json, write_text
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        out = validate()
        write_json(ROOT / "reports" / "gpu_validation.json", out)
        write_text(ROOT / "reports" / "gpu_validation.md", validation_report(out))
        print(json.dumps(out["stats"], indent=1))
