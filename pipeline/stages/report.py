"""Stage report: reports/REPORT.md and reports/metrics.json, generated from the results; never edited by hand."""
from pipeline.config import ROOT
from pipeline.params import load
from pipeline.reporting.report import build
from pipeline.results import write_json, write_text
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        text, metrics = build(load(), ROOT)
        write_text(ROOT / "reports" / "REPORT.md", text)
        write_json(ROOT / "reports" / "metrics.json", metrics)
