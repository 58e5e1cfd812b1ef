"""The engine's tokens equal Hugging Face generate run on each request alone, token for token, for every policy."""
import random

import pytest
import torch

from engine.runner import ModelRunner
from pipeline.prompts import CHAT, chat_ids
from tests.conftest import hf_reference
from tests.scenario import run_scenario

POLICIES = [
    {"name": "naive", "max_seats": 3},
    {"name": "static", "max_seats": 3, "max_batch": 3},
    {"name": "dynamic", "max_seats": 3, "max_batch": 3, "max_wait_ms": 1500},
    {"name": "bucketed", "max_seats": 3, "max_batch": 3, "max_wait_ms": 1500},
    {"name": "continuous", "max_seats": 3},
    {"name": "mixed", "max_seats": 3},
    {"name": "chunked", "max_seats": 3, "token_budget": 16},
]
ARRIVE = {0: [0, 1], 3: [2], 4: [3, 4], 20: [5]}   # seed 000's scenario: six requests, three seats
LENS = [12, 30, 5, 40, 30, 12]


def seed_prompts(vocab: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 23, 4, 31, 17, 40)]


@pytest.fixture(scope="module")
def references(tiny):
    name, model = tiny
    prompts = seed_prompts(model.config.vocab_size)
    return name, model, prompts, [hf_reference(model, p, n) for p, n in zip(prompts, LENS)]


@pytest.mark.parametrize("policy", POLICIES, ids=[p["name"] for p in POLICIES])
def test_seed_scenario_matches_generate(references, policy):
    name, model, prompts, ref = references
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{name} {policy['name']}: request {i} differs"


@pytest.mark.parametrize("seed", range(3))
def test_randomized_arrivals_match_generate(tiny_llama, seed):
    """Random arrivals, seat counts, prompt and output lengths, and policy."""
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    lens = [rng.randint(1, 25) for _ in range(n)]
    arrive: dict[int, list[int]] = {}
    for i in range(n):
        arrive.setdefault(rng.randint(0, 30), []).append(i)
    seats = rng.randint(1, 5)
    policy = rng.choice([{"name": "continuous"}, {"name": "mixed"}, {"name": "chunked", "token_budget": rng.randint(2, 40)},
                         {"name": "dynamic", "max_batch": seats, "max_wait_ms": 2000}])
    out = run_scenario(tiny_llama, {**policy, "max_seats": seats}, prompts, lens, arrive)
    for i in range(n):
        assert out[str(i)] == hf_reference(tiny_llama, prompts[i], lens[i]), f"{policy} seats={seats}: request {i}"


class WrongPositionsRunner(ModelRunner):
    """Seed 000's break-it: every decode row gets the longest row's position instead of its own."""

    def plan(self, out):
        ids, attn, rows = super().plan(out)
        if attn.dec_tok is not None:
            attn.positions = attn.positions.clone()
            attn.positions[attn.dec_tok] = attn.dec_len - 1
        return ids, attn, rows


def test_wrong_position_ids_are_caught(references):
    name, model, prompts, ref = references
    out = run_scenario(model, {"name": "continuous", "max_seats": 3}, prompts, LENS, ARRIVE,
                       runner_cls=WrongPositionsRunner)
    differ = [i for i in range(len(ref)) if out[str(i)] != ref[i]]
    assert differ, f"{name}: broken position ids went unnoticed"


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES, ids=[p["name"] for p in POLICIES])
def test_real_model_seed_scenario(smollm2, policy):
    """Seed 000's test_engine.py on SmolLM2-135M-Instruct: its six chat prompts, three seats."""
    model, tok = smollm2
    prompts = [chat_ids(tok, CHAT[i]) for i in range(6)]
    key = "_smollm2_ref"
    if not hasattr(test_real_model_seed_scenario, key):
        setattr(test_real_model_seed_scenario, key, [hf_reference(model, p, n) for p, n in zip(prompts, LENS)])
    ref = getattr(test_real_model_seed_scenario, key)
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    for i in range(6):
        assert out[str(i)] == ref[i], (i, tok.decode(ref[i]), tok.decode(out[str(i)]))
