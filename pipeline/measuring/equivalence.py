"""Seed 000's equivalence scenario: six requests, at most three running, staggered arrivals, one step per virtual
second; the reference is Hugging Face generate on each request alone (engine.model.hf)."""
import math

import torch

from engine import SamplingParams
from engine.factory import AS_LOADED, build_engine, build_net
from engine.model.hf import generate_alone
from engine.model.loader import eos_ids
from engine.specs import PolicySpec
from pipeline.workloads.prompts import CHAT, chat_ids

ARRIVE = {0: [0, 1], 3: [2], 4: [3, 4], 20: [5]}
LENS = [12, 30, 5, 40, 30, 12]
POLICIES = [  # every policy, 3 running at once
    PolicySpec.of("naive", 3),
    PolicySpec.of("static", 3, max_batch=3),
    PolicySpec.of("dynamic", 3, max_batch=3, max_wait_ms=1500),
    PolicySpec.of("bucketed", 3, max_batch=3, max_wait_ms=1500),
    PolicySpec.of("continuous", 3),
    PolicySpec.of("mixed", 3),
    PolicySpec.of("chunked", 3, token_budget=16),
]
STEP_KINDS = ("static", "continuous", "chunked")  # a padded batch with finished rows; whole prompts or decodes, one
# row at times (naive's only kind); prompt chunks beside decodes: every kind of step the other policies take


def run_scenario(model, policy: PolicySpec, prompts, lens, arrive: dict[int, list[int]], max_request_tokens: int = 256,
                 runner=None, max_steps: int = 5000, compile: bool = False,
                 graphs: bool = False) -> dict[str, list[int]]:
    """Arrivals at given steps on a virtual clock of 1 s per step; returns rid -> output tokens. model: a FlatModel
    or a Hugging Face model; runner: a ready runner to use instead (a broken one shows the check fails)."""
    clock = [0.0]
    eng = build_engine(model, policy, max_request_tokens, eos_ids=eos_ids(model), clock=lambda: clock[0],
                       compile=compile, graphs=graphs, runner=runner)
    reqs, step = {}, 0
    while step < max_steps and (step <= max(arrive) or eng.has_work()):
        for i in arrive.get(step, []):
            reqs[str(i)] = eng.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=lens[i], ignore_eos=True))
        eng.step()
        clock[0] += 1.0
        step += 1
    assert not eng.has_work(), f"{policy.name} did not finish in {max_steps} steps"
    return {rid: r.output for rid, r in reqs.items()}


def scenario_prompts(model, tokenizer) -> list[list[int]]:
    """Seed 000's six chat prompts (random ids of similar lengths for a model without a tokenizer)."""
    if tokenizer is not None:
        return [chat_ids(tokenizer, CHAT[i]) for i in range(6)]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 23, 4, 31, 17, 40)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs differ, None where they are equal; outputs of different lengths
    differ at the shorter one's end (a truncated output is no match)."""
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if k == len(a) == len(b) else k


def divergence_gap(model, prompt: list[int], expected: list[int], got: list[int]) -> float | None:
    """Where the engine's tokens first leave the reference's: how far below the reference's best logit, in the
    reference's own logits at that position, the engine's choice scores (None: no divergence; inf: one output ends
    there, the other goes on)."""
    k = first_divergence(got, expected)
    if k is None:
        return None
    if k == min(len(got), len(expected)):
        return math.inf
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + expected[:k]], device=model.device)).logits[0, -1].float()
    return logits.max().item() - logits[got[k]].item()


def check(model, tokenizer, precision=None, gguf=None, tie: float | None = None) -> dict[str, int]:
    """Policy -> how many of the scenario's requests the engine (at `precision`, engine.specs.PrecisionSpec; None: the
    model as loaded; `gguf`: the file of a level that reads one)
    answers as generate does: token for token (tie None), or up to a first divergence at a near-tie, where the
    reference's best logit beats the engine's choice by at most `tie` (bench.precision.near_tie)."""
    prompts = scenario_prompts(model, tokenizer)
    ref = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    net, matches = build_net(model, precision or AS_LOADED, gguf), {}
    for policy in POLICIES:
        out = run_scenario(net, policy, prompts, LENS, ARRIVE)
        ok = 0
        for i, expected in enumerate(ref):
            gap = divergence_gap(model, prompts[i], expected, out[str(i)]) if tie is not None else None
            ok += out[str(i)] == expected or (gap is not None and gap <= tie)
        matches[policy.name] = ok
        print(f"{policy.name}: {ok}/{len(ref)} requests as generate answers them", flush=True)
    return matches
