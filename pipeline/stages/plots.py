"""Stage plots: the charts of every result (reports/plots/: PNG, and CSV for `dvc plots`)."""
from pipeline.config import ROOT
from pipeline.reporting.plots import draw_all
from pipeline.results import owns
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        owns(ROOT / "reports" / "plots")
        draw_all(ROOT / "data" / "results", ROOT / "reports" / "plots")
