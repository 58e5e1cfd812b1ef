"""Which model configs the engine runs: each supported variation matches generate token for token; every config
field the flat forward pass does not compute is refused with a ValueError naming it."""
import re
from dataclasses import replace

import pytest
import torch

from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.factory import build_net
from engine.kernels import build
from engine.model.hf import generate_alone
from engine.model.kv_cache import make_cache
from engine.model.layers.attention import DenseDecode
from engine.model.loader import random_model
from engine.model.runner import ModelRunner
from engine.model.weights import LAYER_WEIGHTS
from engine.specs import PolicySpec
from pipeline.config import policy_spec
from pipeline.measuring.equivalence import run_scenario

BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
        "initializer_range": 0.1, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
PROMPT_LENS = (9, 23, 40)  # tokens; arrivals at steps 0, 0 and 3
OUTPUT_LENS = (12, 20, 8)


def tiny(model_type: str, **fields):
    """A random tiny model of BASE's shape with `fields` overriding its config; its norm weights (ones in Hugging
    Face's initialisation) made random so that they count."""
    return random_norms(random_model({"model_type": model_type, **BASE, **fields}, seed=0))


def random_norms(model):
    """`model` with noise added to every norm weight (seeded), so that a norm computed wrongly changes the tokens."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def assert_matches_generate(model, policy):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out = run_scenario(model, replace(policy, max_running=3), prompts, OUTPUT_LENS, {0: [0, 1], 3: [2]},
                       max_request_tokens=64)
    for i, (p, n) in enumerate(zip(prompts, OUTPUT_LENS)):
        assert out[str(i)] == generate_alone(model, p, n), f"{policy.name}: request {i}"


def prefill_logits_error(model, prompt: list[int], net=None) -> float:
    """Largest |engine - Hugging Face| logit over every position of one whole prompt (the engine's is ~2e-6 here);
    net: the engine's model of `model` (default: built as it is)."""
    net = net or build_net(model)
    runner = ModelRunner(net, make_cache("slot", net, 1, 64))
    chunk = ScheduledChunk(rid="r", start=0, tokens=tuple(prompt), sample=True, prompt=True, seat=0)
    inputs = replace(runner.inputs(SchedulerOutput(chunks=(chunk,))), logit_rows=torch.arange(len(prompt)))
    got = net.forward(inputs, runner.cache)
    with torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0].float()
    return (got - ref).abs().max().item()


SUPPORTED = {
    "llama-biases-everywhere": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama-explicit-head-dim": ("llama", {"head_dim": 32}),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-rope-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "qwen2-qkv-biases": ("qwen2", {}),
    "qwen2-window-on-every-layer": ("qwen2", {"use_sliding_window": True, "max_window_layers": 0,
                                              "sliding_window": 6}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "mistral-window-longer-than-any-sequence": ("mistral", {}),  # Mistral's default, 4096
    "mistral-window-shorter-than-prompts": ("mistral", {"sliding_window": 6}),
}


CHUNKED = policy_spec("chunked", token_budget=16)  # prompt chunks from later positions, steps of both kinds


@pytest.mark.parametrize("variant", SUPPORTED)
def test_supported_variation_matches_generate(variant):
    model_type, fields = SUPPORTED[variant]
    model = tiny(model_type, **fields)
    if "bias" in variant:
        assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("bias"))
    assert_matches_generate(model, CHUNKED)
    # greedy tokens of a tiny model can hide an error of 1e-3 (GELU's tanh form for its exact one): logits too
    assert prefill_logits_error(model, list(range(3, 43))) < 1e-4


@pytest.mark.parametrize("policy", [policy_spec("continuous"), policy_spec("dynamic", max_batch=3)],
                         ids=["continuous", "dynamic"])
@pytest.mark.parametrize("model_type, fields", [SUPPORTED["mistral-window-shorter-than-prompts"],
                                                SUPPORTED["qwen2-window-on-every-layer"]], ids=["mistral", "qwen2"])
def test_window_with_whole_prompts_matches_generate(model_type, fields, policy):
    """continuous: whole prompts from position 0, windowed; dynamic: one batch's prompts, then zombie rows."""
    assert_matches_generate(tiny(model_type, **fields), policy)


def test_window_shorter_than_the_prompt_changes_the_tokens():
    """The window case above tests something: with the same weights and no window, generate's tokens differ."""
    windowed = tiny("mistral", sliding_window=6)
    full = tiny("mistral", sliding_window=None)
    prompt = list(range(3, 43))
    assert generate_alone(windowed, prompt, 8) != generate_alone(full, prompt, 8)
    assert build_net(windowed).window == 6 and build_net(full).window is None


REFUSED = {
    "hidden_act": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "rope_type": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "partial_rotary_factor": ("llama", {"partial_rotary_factor": 0.5}),
    "final_logit_softcapping": ("llama", {"final_logit_softcapping": 30.0}),
    "attn_logit_softcapping": ("mistral", {"attn_logit_softcapping": 50.0}),
    "use_qk_norm": ("llama", {"use_qk_norm": True}),
    "layer_types": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": 6}),
    "model_type": ("olmo2", {}),
}


@pytest.mark.parametrize("field", REFUSED)
def test_unsupported_config_field_is_refused_by_name(field):
    model_type, fields = REFUSED[field]
    model = tiny(model_type, **fields)
    with pytest.raises(ValueError, match=re.escape(field)):
        build_net(model)


def test_unknown_layer_parameter_is_refused_by_name():
    """A weight the forward pass would skip (here a q/k norm added to a Llama layer) is refused, not ignored."""
    model = tiny("llama")
    model.model.layers[1].self_attn.q_norm = torch.nn.LayerNorm(16)
    with pytest.raises(ValueError, match=re.escape("1.self_attn.q_norm.weight")):
        build_net(model)


def test_output_projection_bias_is_refused():
    model = tiny("llama")
    model.lm_head.bias = torch.nn.Parameter(torch.ones(512))
    with pytest.raises(ValueError, match=re.escape("lm_head.bias")):
        build_net(model)


def test_a_large_shape_is_made_in_its_dtype_with_its_rotary_frequencies():
    """A hidden size of 2048 or more takes the path of the 8B shape: allocated empty on the device in the target
    dtype and filled there (never materialised in fp32); the rotary frequencies the meta device lost are computed
    again, so the engine and generate still agree."""
    cfg = {**BASE, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 1,
           "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}
    model = random_model({"model_type": "llama", **cfg}, seed=0, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fresh = type(model.model.rotary_emb)(model.config)
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.inv_freq)
    assert 0.01 < model.model.layers[0].mlp.up_proj.weight.float().std().item() < 0.03
    prompt = torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    out = run_scenario(model, PolicySpec.of("continuous", 1), [prompt], [6], {0: [0]}, max_request_tokens=32)
    assert out["0"] == generate_alone(model, prompt, 6)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope", [{}, LLAMA3, YARN])
def test_rotary_table_rows_are_the_rotary_modules_own_values(rope):
    """Each eager step's cos and sin are rows of one table (grown as steps reach further): bit-equal to what the
    model's rotary module computes for those positions alone, as a traced step does, the table's growth included."""
    fields = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    net = build_net(tiny("llama", **fields))
    gen = torch.Generator().manual_seed(0)
    for end in (1, 5, 40, 256):
        positions = torch.randint(0, end, (7,), generator=gen)
        table, own = net.rotary.tables(positions, end, traced=False), net.rotary.tables(positions, end, traced=True)
        assert net.rotary._table[0].shape[0] >= end
        assert torch.equal(table[0], own[0]) and torch.equal(table[1], own[1])
    cos, sin = net.rotary.module(net.norm, positions[None])  # and both are the module's, sin's first half negated
    half = net.head_dim // 2
    assert torch.equal(own[0], cos[0]) and torch.equal(own[1][:, half:], sin[0, :, half:])
    assert torch.equal(own[1][:, :half], -sin[0, :, :half])


@pytest.mark.skipif(build.ops() is None, reason="no native kernels")
def test_the_one_call_layer_takes_the_weights_python_passes():
    """lab.layers' weights a layer, named by the loaded build (capabilities), are the engine's LAYER_WEIGHTS in order;
    a tiny Llama's decode step runs through that one call."""
    assert tuple(build.capabilities()["layer_weights"]) == LAYER_WEIGHTS
    net = build_net(tiny("llama"))
    assert net.one_call and net._lab_args(4, DenseDecode(1, 4)) is not None
