"""Stage bench_fleet: a fleet of engine servers behind the routing server, each router policy, against one server of
all the threads, with the fleet simulator's prediction of every run (pipeline.measuring.fleet;
data/results/fleet.json)."""
import json

from omegaconf import OmegaConf

from pipeline.config import ROOT, load_net
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.fleet import run_fleet
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage
from pipeline.workloads.generate import tokenizer_and_vocab

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        out = run_fleet(load_net(cfg)[0], tokenizer_and_vocab(cfg), cfg)
        out.update({"config": {"bench": OmegaConf.to_container(cfg.bench.fleet), "seed": int(cfg.seed)},
                    "machine": environment(cfg.threads, cfg.precision.device)})
        write_json(ROOT / "data" / "results" / "fleet.json", out)
        print(json.dumps({"overhead": out["overhead"], "agreement": out["agreement"]}, indent=1))
