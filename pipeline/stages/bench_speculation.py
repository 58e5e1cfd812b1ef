"""Stage bench_speculation: speculative decoding (prompt lookup) against batching on a copying and a chat workload,
each cell beside the simulator's prediction (data/results/speculation.json)."""
import json

from scipy.stats import spearmanr

from engine import threads
from engine.core.simulator import CostModel
from engine.model.loader import eos_ids
from pipeline.config import ROOT, group_entry, load_net
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.speculation import measure, simulate, stops_paying
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
        results = ROOT / "data" / "results"
        cost = CostModel(**json.loads((results / "cost_model.json").read_text())["cost_model"])
        ngram = group_entry("speculative", "ngram")
        lookup = (int(ngram["prompt_lookup_min"]), int(ngram["prompt_lookup_max"]))
        net, tok = load_net(cfg)
        bench, seats = cfg.bench.speculation, int(cfg.max_request_tokens)
        rows = measure(net, tok, bench, lookup, cost, seats, eos_ids(net))
        for row, sim in zip(rows, simulate(rows, cost, seats, int(cfg.seed))):
            row.update({f"sim_{k}": v for k, v in sim.items()})
        fit = {m: float(spearmanr([r[m] for r in rows], [r[f"sim_{m}"] for r in rows]).statistic)
               for m in ("throughput_tok_s", "tpot_p50_ms")}
        write_json(results / "speculation.json",
                   {"rows": rows, "lookup": lookup, "max_new_tokens": int(bench.max_new_tokens),
                    "stops_paying": {w: stops_paying(rows, w) for w in bench.workloads}, "sim_spearman": fit,
                    "machine": environment(cfg.threads, cfg.precision.device)})
