"""Stage engine_speed: the engine at each precision level (bench.engine_speed.levels, the configured one first)
against Hugging Face generate on the same model and requests, in one process (reports/engine_speed.json)."""
import json

import torch

from engine import threads
from pipeline.config import ROOT
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.levels import level_nets
from pipeline.measuring.timing import engine_speed
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        torch.manual_seed(int(cfg.seed))
        threads.govern(int(cfg.threads), cfg.measure)
        names = list(dict.fromkeys([cfg.precision.name, *(cfg.bench.engine_speed.get("levels") or [])]))
        levels, skipped, tokenizer = level_nets(cfg, names)
        probe = ROOT / "reports" / "hardware.json"
        bandwidth = json.loads(probe.read_text())["bandwidth_gbs"] if probe.exists() else None
        rows = [{**r, "model": cfg.model.name}
                for r in engine_speed(levels, tokenizer, cfg.bench.engine_speed, cfg.measure, bandwidth)]
        write_json(ROOT / "reports" / "engine_speed.json",
                   {"machine": environment(cfg.threads, cfg.precision.device), "rows": rows, "skipped": skipped})
