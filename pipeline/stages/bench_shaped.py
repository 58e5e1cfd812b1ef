"""Stage bench_shaped: every policy on production-shaped workloads under bursty arrivals, measured on the engine at
one load near capacity and simulated over loads, with capacity at the SLO (pipeline.modeling.shaped;
data/results/shaped.json)."""
import json

from omegaconf import OmegaConf

from engine import threads
from engine.core.simulator import CostModel
from pipeline.config import ROOT, load_net
from pipeline.measuring.fingerprint import environment
from pipeline.modeling.shaped import run
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage
from pipeline.workloads.generate import tokenizer_and_vocab

RESULTS = ROOT / "data" / "results"

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
        fitted = json.loads((RESULTS / "cost_model.json").read_text())
        tok, vocab = tokenizer_and_vocab(cfg)
        out = run((load_net(cfg)[0], tok, vocab), CostModel(**fitted["cost_model"]), cfg)
        out.update({"config": {"bench": OmegaConf.to_container(cfg.bench.shaped), "seed": int(cfg.seed)},
                    "machine": environment(cfg.threads, cfg.precision.device)})
        write_json(RESULTS / "shaped.json", out)
        print(json.dumps({"loads": out["loads"], "agreement": out["agreement"]}, indent=1))
