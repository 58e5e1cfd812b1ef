"""A model held in bf16 (precision=bf16-cuda's engine, run here on the CPU): the seed scenario against Hugging Face
`generate` in bf16.

Two bf16 forward passes that add in different orders round differently, so exact equality is not the rule. The rule
enforced: each request's tokens equal the reference's up to its first divergence, and a divergence is allowed only
at a near-tie of the reference's own logits there: the engine's token scores within two bf16 steps (ulps) of the
reference's best.
"""
import pytest
import torch

from engine.factory import load_source
from engine.model.hf import generate_alone
from engine.specs import PrecisionSpec
from pipeline.config import compose_config
from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, first_divergence, run_scenario, scenario_prompts
from tests.conftest import TINY, model_cfg


def ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (torch.tensor(abs(x)).log2().floor().item() - 7)


@pytest.fixture(scope="module", params=TINY)
def bf16(request):
    precision = compose_config(["precision=bf16-cuda", "precision.device=cpu"]).precision
    model, _ = load_source(model_cfg(request.param), PrecisionSpec(dtype=precision.dtype, device=precision.device))
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = scenario_prompts(model, None)
    return request.param, model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


def agreement(label: str, model, prompts, ref, out) -> list[int]:
    """Tokens equal before each request's first divergence; fails unless every divergence is a near-tie of the
    reference's own logits (within two bf16 steps of its best), and on an output shorter or longer than the
    reference's."""
    agreed = []
    for i, expected in enumerate(ref):
        got = out[str(i)]
        k = first_divergence(got, expected)
        agreed.append(len(expected) if k is None else k)
        if k is None:
            continue
        assert k < min(len(got), len(expected)), (
            f"{label}: request {i} has {len(got)} tokens, the reference {len(expected)}; equal up to token {k}")
        with torch.inference_mode():
            ids = torch.tensor([prompts[i] + expected[:k]], device=model.device)
            logits = model(ids).logits[0, -1].float()
        best = logits.max().item()
        assert best - logits[got[k]].item() <= 2 * ulp(best), (
            f"{label}: request {i} diverges at token {k} where the reference's best logit {best} "
            f"beats the engine's choice by {best - logits[got[k]].item()}, more than two bf16 steps")
    return agreed


@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_bf16_tokens_agree_up_to_near_ties(bf16, policy):
    name, model, prompts, ref = bf16
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    agreed = agreement(f"{name} {policy.name}", model, prompts, ref, out)
    print(f"{name} {policy.name} bf16: tokens equal before the first divergence {agreed} of {LENS}")
