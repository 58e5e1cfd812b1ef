"""Stage check_equivalence: seed 000's scenario for every policy on the configured model; exits 1 if any token
differs from Hugging Face generate run on each request alone. Writes reports/equivalence.json."""
import sys

from engine.hf import generate_alone
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.equivalence import ARRIVE, LENS, POLICIES, run_scenario, scenario_prompts
from pipeline.io import write_json


def main(cfg) -> dict:
    model, tok = load_configured_model(cfg)
    prompts = scenario_prompts(model, tok)
    ref = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    result = {}
    for policy in POLICIES:
        out = run_scenario(model, policy, prompts, LENS, ARRIVE)
        result[policy["name"]] = sum(out[str(i)] == ref[i] for i in range(6))
        print(f"{policy['name']}: {result[policy['name']]}/6 requests token-equal to generate", flush=True)
    write_json(ROOT / "reports" / "equivalence.json", {"model": cfg.model.name, "dtype": cfg.precision.dtype,
                                                       "matches": result, "requests": 6,
                                                       "machine": environment(cfg.threads, cfg.precision.device)})
    return result


if __name__ == "__main__":
    res = main(load())
    sys.exit(0 if all(v == 6 for v in res.values()) else 1)
