"""The engine's tokens equal Hugging Face generate run on each request alone, token for token, for every policy."""
import random

import pytest

from engine.runner import ModelRunner
from engine.hf import generate_alone
from pipeline.equivalence import ARRIVE, LENS, POLICIES, run_scenario, scenario_prompts


@pytest.fixture(scope="module")
def references(tiny):
    name, model = tiny
    prompts = scenario_prompts(model, None)
    return name, model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


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
        assert out[str(i)] == generate_alone(tiny_llama, prompts[i], lens[i]), f"{policy} seats={seats}: request {i}"


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
    prompts = scenario_prompts(model, tok)
    key = "_smollm2_ref"
    if not hasattr(test_real_model_seed_scenario, key):
        setattr(test_real_model_seed_scenario, key, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)])
    ref = getattr(test_real_model_seed_scenario, key)
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    for i in range(6):
        assert out[str(i)] == ref[i], (i, tok.decode(ref[i]), tok.decode(out[str(i)]))


@pytest.mark.slow
def test_compiled_decode_steps_match_generate(references):
    """FlatModel.forward(compiled=True): the steps of decodes only run through torch.compile (graphs of one and of
    several rows, with and without a length mask); the tokens stay those of generate."""
    name, model, prompts, ref = references
    out = run_scenario(model, {"name": "continuous", "max_seats": 3}, prompts, LENS, ARRIVE, compile=True)
    one = run_scenario(model, {"name": "continuous", "max_seats": 1}, prompts[:2], LENS[:2], {0: [0, 1]},
                       compile=True)
    assert [out[str(i)] for i in range(6)] == ref, name
    assert [one["0"], one["1"]] == ref[:2], name


def test_left_padding_costs_tokens_not_correctness(references):
    """pad_prompts: the batch's prompts padded to its longest, computed and discarded; the answers do not change."""
    name, model, prompts, ref = references
    policy = {"name": "static", "max_seats": 3, "max_batch": 3, "pad_prompts": True}
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    assert all(out[str(i)] == ref[i] for i in range(6)), name
