"""The engine's tokens equal Hugging Face generate run on each request alone, token for token, for every policy."""
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from engine import SamplingParams
from engine.core.request import Status
from engine.factory import build_engine, build_net
from engine.model.forward import MLP_ROWS
from engine.model.hf import generate_alone
from engine.model.kv_cache import make_cache
from engine.model.loader import random_model
from engine.model.runner import ModelRunner
from engine.specs import PolicySpec
from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, STEP_KINDS, run_scenario, scenario_prompts

REAL_POLICIES = [p for p in POLICIES if p.name in STEP_KINDS]  # on a real model: one policy per kind of step


@pytest.fixture(scope="module")
def references(tiny):
    name, model = tiny
    prompts = scenario_prompts(model, None)
    return name, model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


@pytest.fixture(scope="module")
def llama_references(tiny_llama):
    """references() of tiny-llama alone: a compile-time property (what gets compiled when) is the same on each."""
    prompts = scenario_prompts(tiny_llama, None)
    return "tiny-llama", tiny_llama, prompts, [generate_alone(tiny_llama, p, n) for p, n in zip(prompts, LENS)]


@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_seed_scenario_matches_generate(references, policy):
    name, model, prompts, ref = references
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{name} {policy.name}: request {i} differs"


RANDOM_POLICIES = ["naive", "static", "dynamic", "bucketed", "continuous", "mixed", "chunked-under", "chunked-over"]
_scenarios: dict[int, tuple] = {}  # seed -> (scenario, generate's outputs)


def random_scenario(model, seed: int):
    """Random seats, prompt and output lengths and arrivals (a whole number of batches per seat count), with
    generate's tokens for each request; made once per seed."""
    if seed not in _scenarios:
        rng = random.Random(seed)
        seats = rng.randint(2, 4)
        n = seats * rng.randint(2, 3)  # static launches only full batches
        prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(n)]
        lens = [rng.randint(1, 25) for _ in range(n)]
        arrive: dict[int, list[int]] = {}
        for i in range(n):
            arrive.setdefault(rng.randint(0, 30), []).append(i)
        ref = [generate_alone(model, p, k) for p, k in zip(prompts, lens)]
        _scenarios[seed] = (seats, prompts, lens, arrive), ref
    return _scenarios[seed]


def random_policy(name: str, seats: int, rng: random.Random) -> PolicySpec:
    """chunked-under: a token budget (2 or more) below the seat count, so the budget, not the seats, caps the rows
    of a step and decodes can take all of it while prompts wait; chunked-over: a budget above the seat count."""
    if name == "chunked-under":
        return PolicySpec.of("chunked", seats + 2, token_budget=rng.randint(2, seats + 1))
    if name == "chunked-over":
        return PolicySpec.of("chunked", seats, token_budget=rng.randint(seats + 1, 40))
    if name in ("dynamic", "bucketed"):
        return PolicySpec.of(name, seats, max_batch=seats, max_wait_ms=rng.choice([0, 2000, 5000]))
    if name == "static":
        return PolicySpec.of(name, seats, max_batch=seats)
    return PolicySpec.of(name, seats)


def test_random_arrivals_cover_every_policy():
    assert {p.name for p in POLICIES} == {random_policy(n, 3, random.Random(0)).name for n in RANDOM_POLICIES}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", RANDOM_POLICIES)
def test_randomized_arrivals_match_generate(tiny_llama, name, seed):
    """Every policy on random arrivals, seat counts, prompt and output lengths."""
    (seats, prompts, lens, arrive), ref = random_scenario(tiny_llama, seed)
    policy = random_policy(name, seats, random.Random(f"{name}{seed}"))
    out = run_scenario(tiny_llama, policy, prompts, lens, arrive)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{policy}: request {i}"


def test_abort_during_a_chunked_prefill_frees_its_seat(tiny_llama):
    """A prompt cut by the token budget is aborted half computed: its seat is free on the next step, the other
    request's tokens are generate's, and a shorter prompt placed in that seat ignores the K/V left there."""
    clock = [0.0]
    eng = build_engine(tiny_llama, PolicySpec.of("chunked", 2, token_budget=8), max_request_tokens=64,
                    clock=lambda: clock[0])
    prompts = {"other": [20, 21, 22, 23, 24], "long": list(range(100, 130)), "late": [7, 8, 9, 11, 12]}
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    other = eng.add_request("other", prompts["other"], params)
    long = eng.add_request("long", prompts["long"], params)
    for _ in range(3):
        eng.step()
        clock[0] += 1.0
    assert long.in_prompt and long.num_computed == 3 + 7 + 7 and long.seat == 1  # 17 of its 30 prompt tokens
    assert eng.abort("long").finish_reason == "abort"
    assert eng.scheduler.seats.num_free == 1 and long.status is Status.FINISHED
    late = eng.add_request("late", prompts["late"], params)
    eng.step()
    assert late.seat == 1 and late.status is Status.RUNNING
    while eng.has_work():
        eng.step()
    for req in (other, late):
        assert req.output == generate_alone(tiny_llama, prompts[req.rid], 10), req.rid


@pytest.fixture(scope="module")
def long_context_llama():
    """tiny-llama with room for prompts of a few MLP passes (engine.model.forward.MLP_ROWS tokens each)."""
    tiny = OmegaConf.load(Path(__file__).resolve().parents[3] / "conf" / "model" / "tiny-llama.yaml")
    cfg = {**OmegaConf.to_container(tiny.config), "max_position_embeddings": 4096}
    return random_model(cfg, seed=1)


@pytest.mark.parametrize("policy", [PolicySpec.of("continuous", 3),
                                    PolicySpec.of("chunked", 3, token_budget=1500)],
                         ids=["continuous", "chunked"])
def test_prompts_longer_than_a_row_block_match_generate(long_context_llama, policy):
    """Prompts of 1,100 and 2,100 tokens (1 and 2 whole MLP blocks plus a tail) and a short one, staggered."""
    assert MLP_ROWS < 1100 < 2 * MLP_ROWS < 2100 < 3 * MLP_ROWS
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1100, 2100, 20)]
    lens = [6, 6, 12]
    out = run_scenario(long_context_llama, policy, prompts, lens, {0: [0], 1: [1, 2]}, max_request_tokens=2200)
    for i in range(3):
        assert out[str(i)] == generate_alone(long_context_llama, prompts[i], lens[i]), f"{policy.name}: {i}"


class WrongPositionsRunner(ModelRunner):
    """Seed 000's break-it: every decode row gets the longest row's position instead of its own."""

    def inputs(self, plan):
        inputs = super().inputs(plan)
        starts = torch.tensor([0] + [len(c.tokens) for c in plan.chunks]).cumsum(0)[:-1]
        dec = starts[torch.tensor([len(c.tokens) == 1 for c in plan.chunks])]  # the decode rows, whatever the path
        if len(dec):
            inputs.positions = inputs.positions.clone()
            inputs.positions[dec] = inputs.positions[dec].max()
        return inputs


def test_wrong_position_ids_are_caught(references):
    name, model, prompts, ref = references
    net = build_net(model)
    runner = WrongPositionsRunner(net, make_cache("slot", net, 3, 256))
    out = run_scenario(net, PolicySpec.of("continuous", 3), prompts, LENS, ARRIVE, runner=runner)
    differ = [i for i in range(len(ref)) if out[str(i)] != ref[i]]
    assert differ, f"{name}: broken position ids went unnoticed"


@pytest.mark.slow
@pytest.mark.parametrize("policy", REAL_POLICIES, ids=[p.name for p in REAL_POLICIES])
def test_real_model_seed_scenario(smollm2, policy):
    """Seed 000's test_engine.py on SmolLM2-135M-Instruct: its six chat prompts, three seats, under a policy of each
    kind of step (every policy runs on the tiny models here and on this model in the check_equivalence stage)."""
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
def test_compiled_steps_warm_up_front_and_match_generate(llama_references):
    """FlatModel.forward(compiled=True): LLMEngine.warm_up compiles each kind of compiled step (decodes of one and of
    several rows, of equal and unequal lengths) before any request; the scenario that follows compiles nothing more,
    breaks no step into eager pieces, and its tokens stay those of generate, as do one seat's (tiny-llama: each
    architecture's steps are the same compiled products)."""
    from torch._dynamo.utils import counters

    name, model, prompts, ref = llama_references
    policy, net = PolicySpec.of("continuous", 3), build_net(model)
    counters.clear()
    assert build_engine(net, policy, 256, compile=True).warm_up() > 0
    compiled = counters["stats"]["unique_graphs"]
    out = run_scenario(net, policy, prompts, LENS, ARRIVE, compile=True)
    assert [out[str(i)] for i in range(6)] == ref, name
    assert counters["stats"]["unique_graphs"] == compiled, f"{name}: compiled after the warm-up"
    assert not counters["graph_break"], dict(counters["graph_break"])  # a step is whole graphs, not eager pieces
    one = run_scenario(net, PolicySpec.of("continuous", 1), prompts[:2], LENS[:2], {0: [0, 1]}, compile=True)
    assert [one["0"], one["1"]] == ref[:2], name


def test_compile_failure_falls_back_to_eager(references, monkeypatch, caplog):
    """A compiler that fails (here: on its first call, as Inductor does without a C++ compiler) leaves the steps
    eager, the reason logged once and kept; the tokens are still those of generate."""
    name, model, prompts, ref = references
    net = build_net(model)

    def broken(fn, **kw):
        def run(*a, **k):
            calls.append(1)
            raise RuntimeError("simulated: no C++ compiler found")
        return run
    calls = []
    monkeypatch.setattr(torch, "compile", broken)
    out = run_scenario(net, PolicySpec.of("continuous", 3), prompts, LENS, ARRIVE, compile=True)
    assert [out[str(i)] for i in range(6)] == ref, name
    assert calls == [1] and net.compiled_step.error == "RuntimeError: simulated: no C++ compiler found"
    assert [r.message for r in caplog.records if "eager" in r.message] == [
        "compiled steps failed; running them eager from now on: RuntimeError: simulated: no C++ compiler found"]


@pytest.mark.parametrize("policy", [PolicySpec.of("continuous", 5), PolicySpec.of("mixed", 5),
                                    PolicySpec.of("dynamic", 5, max_batch=5, max_wait_ms=1500)],
                         ids=lambda p: p.name)
def test_decode_steps_padded_for_graphs_match_generate(references, policy):
    """graphs=True (the shapes CUDA graphs are captured for, run eagerly here): decode steps padded to a power of two
    of seats (3 -> 4 of 5) and a multiple of 128 keys; padded rows write only their seat's last position, which
    no request reaches; the tokens stay those of generate."""
    name, model, prompts, ref = references
    out = run_scenario(model, policy, prompts, LENS, ARRIVE, graphs=True)
    assert [out[str(i)] for i in range(6)] == ref, name


def test_left_padding_costs_tokens_not_correctness(references):
    """pad_prompts: the batch's prompts padded to its longest, computed and discarded; the answers do not change."""
    name, model, prompts, ref = references
    policy = PolicySpec.of("static", 3, max_batch=3, pad_prompts=True)
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    assert all(out[str(i)] == ref[i] for i in range(6)), name
