"""Stage bench_cache: seed 003 §3, the growing torch.cat cache against the slot cache (data/results/cache.json)."""
from engine import threads
from pipeline.config import ROOT, load_net
from pipeline.measuring.cache import BATCH, compare
from pipeline.measuring.fingerprint import environment
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
        net, _ = load_net(cfg)
        write_json(ROOT / "data" / "results" / "cache.json", {"batch": BATCH, "rows": compare(net),
                                                              "machine": environment(cfg.threads,
                                                                                     cfg.precision.device)})
