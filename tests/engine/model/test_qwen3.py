"""Qwen3 (qwen3): a tiny random-weight model (conf/model/tiny-qwen3.yaml), its per-head q/k norms made random so that
they count, gives Hugging Face generate's tokens under every policy on the slot cache (native kernels and ATen's
operators) and under continuous and chunked batching on the paged one; its logits equal Hugging Face's."""
import pytest

from engine.factory import build_net, load_source
from engine.model.hf import generate_alone
from engine.model.models.qwen3 import Qwen3
from engine.specs import PolicySpec
from pipeline.config import kv_spec, model_spec
from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, run_scenario, scenario_prompts
from tests.engine.model.test_model_support import prefill_logits_error, random_norms
from tests.engine.model.test_paged import BS, PAGED_ARRIVE, PAGED_LENS, paged_prompts, run_paged

NATIVE = [True, False]  # the native CPU kernels (where they build), ATen's operators
PAGED = [PolicySpec.of("continuous", 4), PolicySpec.of("chunked", 4, token_budget=7)]


@pytest.fixture(scope="module")
def qwen3():
    model = random_norms(load_source(model_spec("tiny-qwen3"))[0])
    prompts = scenario_prompts(model, None)
    return model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


def test_the_qwen3_architecture_runs_its_q_and_k_norms(qwen3):
    net = build_net(qwen3[0])
    assert isinstance(net, Qwen3) and not net.one_call  # lab.layers computes no q/k norm: the layer loop runs
    assert all(layer.qk_norm.shape == (4 + 2, 16) for layer in net.layers)
    assert net.attn_scale == 16 ** -0.5  # a q norm after the product: nothing folded into the q rows


@pytest.mark.parametrize("native", NATIVE, ids=["native", "aten"])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_seed_scenario_matches_generate(qwen3, policy, native):
    model, prompts, ref = qwen3
    out = run_scenario(build_net(model, native_kernels=native), policy, prompts, LENS, ARRIVE)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{policy.name}: request {i} differs"


@pytest.mark.parametrize("policy", PAGED, ids=[p.name for p in PAGED])
def test_paged_policies_match_generate(qwen3, policy):
    model = qwen3[0]
    prompts = paged_prompts(model)
    kv = kv_spec("paged", block_size=BS, num_blocks=22)  # the longest request fits alone, three do not: preemption
    eng, out, _ = run_paged(model, policy, kv, prompts, PAGED_LENS, PAGED_ARRIVE)
    assert [out[str(i)] for i in range(len(prompts))] == [generate_alone(model, p, n)
                                                            for p, n in zip(prompts, PAGED_LENS)]
    assert eng.scheduler.num_preemptions > 0


def test_prefill_logits_match_hugging_face(qwen3):
    """Greedy tokens of a tiny model can hide a small error (a q/k norm's weight applied twice as 1 + w): logits
    too."""
    assert prefill_logits_error(qwen3[0], list(range(3, 43))) < 1e-4
