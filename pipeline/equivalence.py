"""Seed 000's equivalence scenario: six requests, three seats, staggered arrivals, one step per virtual second.

Stage check_equivalence runs it for every policy on the configured model and fails if any token differs from
Hugging Face generate run on each request alone. Tests reuse `run_scenario` and `generate_alone` (engine.hf).
"""
import sys

import torch

from engine import LLMEngine, SamplingParams
from engine.hf import generate_alone
from engine.loader import eos_ids
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.io import write_json
from pipeline.prompts import CHAT, chat_ids

ARRIVE = {0: [0, 1], 3: [2], 4: [3, 4], 20: [5]}
LENS = [12, 30, 5, 40, 30, 12]
POLICIES = [
    {"name": "naive", "max_seats": 3},
    {"name": "static", "max_seats": 3, "max_batch": 3},
    {"name": "dynamic", "max_seats": 3, "max_batch": 3, "max_wait_ms": 1500},
    {"name": "bucketed", "max_seats": 3, "max_batch": 3, "max_wait_ms": 1500},
    {"name": "continuous", "max_seats": 3},
    {"name": "mixed", "max_seats": 3},
    {"name": "chunked", "max_seats": 3, "token_budget": 16},
]


def run_scenario(model, policy: dict, prompts, lens, arrive: dict[int, list[int]], seat_tokens: int = 256,
                 runner_cls=None, max_steps: int = 5000, compile: bool = False) -> dict[str, list[int]]:
    """Arrivals at given steps on a virtual clock of 1 s per step; returns rid -> output tokens."""
    clock = [0.0]
    eng = LLMEngine(model, policy, seat_tokens, eos_ids=eos_ids(model), clock=lambda: clock[0], compile=compile)
    if runner_cls is not None:
        eng.runner.__class__ = runner_cls
    reqs, step = {}, 0
    while step < max_steps and (step <= max(arrive) or eng.has_work()):
        for i in arrive.get(step, []):
            reqs[str(i)] = eng.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=lens[i], ignore_eos=True))
        eng.step()
        clock[0] += 1.0
        step += 1
    assert not eng.has_work(), f"{policy['name']} did not finish in {max_steps} steps"
    return {rid: r.output for rid, r in reqs.items()}


def scenario_prompts(model, tokenizer) -> list[list[int]]:
    """Seed 000's six chat prompts (random ids of similar lengths for a model without a tokenizer)."""
    if tokenizer is not None:
        return [chat_ids(tokenizer, CHAT[i]) for i in range(6)]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 23, 4, 31, 17, 40)]


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
                                                       "environment": environment(cfg.precision.device)})
    return result


if __name__ == "__main__":
    res = main(load())
    sys.exit(0 if all(v == 6 for v in res.values()) else 1)
