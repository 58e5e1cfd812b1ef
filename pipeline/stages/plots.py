"""Stage plots: the charts of every result (reports/plots/: PNG, and CSV for `dvc plots`)."""
from pipeline.config import ROOT
from pipeline.reporting.plots import draw_all
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        draw_all(ROOT / "data" / "results", ROOT / "reports" / "plots")
