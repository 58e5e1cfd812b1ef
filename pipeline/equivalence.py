"""Seed 000's equivalence scenario: six requests, three seats, staggered arrivals, one step per virtual second.

Used by stage check_equivalence and the tests; the reference is Hugging Face generate alone (engine.hf).
"""
import torch

from engine import LLMEngine, SamplingParams
from engine.loader import eos_ids
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
                 runner_cls=None, max_steps: int = 5000, compile: bool = False,
                 graphs: bool = False) -> dict[str, list[int]]:
    """Arrivals at given steps on a virtual clock of 1 s per step; returns rid -> output tokens."""
    clock = [0.0]
    eng = LLMEngine(model, policy, seat_tokens, eos_ids=eos_ids(model), clock=lambda: clock[0], compile=compile,
                    graphs=graphs)
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
