"""Seed 000's equivalence scenario: six requests, three seats, staggered arrivals, one step per virtual second.

Stage check_equivalence runs it for every policy on the configured model and fails if any token differs from
Hugging Face generate run on each request alone. Tests reuse `run_scenario` and `hf_reference`.
"""
import sys

import torch

from engine import LLMEngine, SamplingParams
from engine.loader import eos_ids, load_model
from pipeline.config import ROOT, load
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


def hf_reference(model, prompt: list[int], n: int) -> list[int]:
    """Hugging Face generate on one request alone: greedy, exactly n new tokens."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_scenario(model, policy: dict, prompts, lens, arrive: dict[int, list[int]], capacity: int = 256,
                 runner_cls=None, max_steps: int = 5000, compile: bool = False) -> dict[str, list[int]]:
    """Arrivals at given steps on a virtual clock of 1 s per step; returns rid -> output tokens."""
    clock = [0.0]
    eng = LLMEngine(model, policy, capacity, eos_ids=eos_ids(model), clock=lambda: clock[0], compile=compile)
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
    torch.set_num_threads(int(cfg.threads))
    model, tok = load_model(cfg.model, cfg.precision.dtype, cfg.precision.device)
    prompts = scenario_prompts(model, tok)
    ref = [hf_reference(model, p, n) for p, n in zip(prompts, LENS)]
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
