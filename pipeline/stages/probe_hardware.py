"""Stage probe_hardware: what this machine can do for the configured model, and what stops a batch
(reports/hardware.json, reports/HARDWARE.md)."""
from engine import threads
from pipeline.config import ROOT, load_source
from pipeline.measuring.hardware import probe
from pipeline.params import load
from pipeline.reporting.hardware import render
from pipeline.results import write_json, write_text
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
        model, _ = load_source(cfg)
        out = probe(cfg, model)
        write_json(ROOT / "reports" / "hardware.json", out)
        write_text(ROOT / "reports" / "HARDWARE.md", render(out))
