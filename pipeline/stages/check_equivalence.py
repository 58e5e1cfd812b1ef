"""Stage check_equivalence: every policy on seed 000's scenario against generate on each request alone
(reports/equivalence.json); fails unless a lossless level matches (model weights: token-equal; else up to near-ties)."""
import sys

from engine import threads
from engine.factory import gguf_file
from pipeline.config import ROOT, load_source, model_spec, precision_spec
from pipeline.measuring.equivalence import LENS, check
from pipeline.measuring.fingerprint import environment
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        threads.govern(int(cfg.threads), cfg.measure)
        model, tok = load_source(cfg)
        p = cfg.precision
        rule = "token-equal" if p.weights == "model" and not p.lossy else "up to near-ties"
        tie = None if rule == "token-equal" else float(cfg.bench.precision.near_tie)
        level = precision_spec(p)
        matches = check(model, tok, level, gguf_file(model_spec(cfg.model), level), tie)
        write_json(ROOT / "reports" / "equivalence.json", {"model": cfg.model.name, "precision": p.name,
                                                           "rule": rule, "near_tie": tie, "matches": matches,
                                                           "requests": len(LENS),
                                                           "machine": environment(cfg.threads, cfg.precision.device)})
        failed = not p.lossy and any(v != len(LENS) for v in matches.values())
    sys.exit(1 if failed else 0)
