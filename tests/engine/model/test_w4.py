"""precision=w4: a GGUF file's blocks read as stored. A tiny Llama is written to a GGUF file as llama.cpp writes one
(Q4_1 layers with q/k rows in llama.cpp's order, a Q8_0 tied embedding) and given the dequantized values, so that
Hugging Face generate computes with the very values the engine reads; the engine's tokens equal generate's up to a
first divergence at a near-tie of the reference's logits (bench.precision.near_tie). On the real model (slow): the
blocks, dequantized, are exactly the prepared fp32 weights, and the seed scenario holds too."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from engine.factory import build_net
from engine.kernels import build as native
from engine.model.gguf import gguf_layers
from engine.model.hf import generate_alone
from engine.model.loader import gguf_path, random_model
from engine.specs import PrecisionSpec
from pipeline.config import compose_config
from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, divergence_gap, run_scenario, scenario_prompts
from tests.conftest import model_cfg

pytestmark = pytest.mark.skipif(native.ops() is None, reason=f"the fused kernels did not build: {native.error}")
Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "rope_theta": 10000.0, "initializer_range": 0.1, "tie_word_embeddings": True, "bos_token_id": 1,
          "eos_token_id": 2}


def llama_cpp_order(rows: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q/k row order to llama.cpp's (convert_hf_to_gguf's permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(a tiny Llama holding the dequantized values, the GGUF file of its blocks)."""
    model = random_model(CONFIG, seed=3)
    path = tmp_path_factory.mktemp("w4") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")

    def store(name, param, qtype, heads=None):
        w = param.detach().numpy()
        blocks = quants.quantize(w, qtype)
        with torch.no_grad():
            param.copy_(torch.from_numpy(quants.dequantize(blocks, qtype)))
        writer.add_tensor(name, llama_cpp_order(blocks, heads) if heads else blocks, raw_dtype=qtype)

    store("token_embd.weight", model.model.embed_tokens.weight, Q8_0)
    for i, layer in enumerate(model.model.layers):
        a, m, b = layer.self_attn, layer.mlp, f"blk.{i}."
        store(b + "attn_q.weight", a.q_proj.weight, Q4_1, CONFIG["num_attention_heads"])
        store(b + "attn_k.weight", a.k_proj.weight, Q4_1, CONFIG["num_key_value_heads"])
        for name, lin in (("attn_v", a.v_proj), ("attn_output", a.o_proj), ("ffn_gate", m.gate_proj),
                          ("ffn_up", m.up_proj), ("ffn_down", m.down_proj)):
            store(b + name + ".weight", lin.weight, Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def agrees(model, prompts, ref, out) -> list[int]:
    """Requests whose tokens differ from generate's other than at a near-tie (should be none)."""
    tie = compose_config([]).bench.precision.near_tie
    return [i for i, expected in enumerate(ref) if out[str(i)] != expected and
            divergence_gap(model, prompts[i], expected, out[str(i)]) > tie]


def test_the_blocks_are_read_in_hugging_faces_row_order(tiny_gguf):
    model, path = tiny_gguf
    _, layers = gguf_layers(path, model.config)
    q = quants.dequantize(layers[0]["qkv"][0], Q4_1)[:CONFIG["hidden_size"]]
    assert np.array_equal(q, model.model.layers[0].self_attn.q_proj.weight.detach().numpy())


@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_w4_tokens_agree_with_generate_up_to_near_ties(tiny_gguf, policy):
    model, path = tiny_gguf
    net = build_net(model, PrecisionSpec(weights="gguf"), path)
    assert net.step_bytes < 0.3 * build_net(model).step_bytes  # the blocks, not an fp32 copy
    prompts = scenario_prompts(model, None)
    ref = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    out = run_scenario(net, policy, prompts, LENS, ARRIVE)
    assert agrees(model, prompts, ref, out) == [], policy.name


def test_the_step_split_counts_the_block_products(tiny_gguf):
    """probe_hardware's split of a w4 decode step counts the Q4_1 layers as matrix products, the Q8_0 head as the
    LM head."""
    from pipeline.measuring.hardware import step_split

    model, path = tiny_gguf
    parts = step_split(build_net(model, PrecisionSpec(weights="gguf"), path), 2, steps=3)["parts"]
    assert parts["matrix products"] > 0 and parts["LM head"] > 0


def test_a_format_it_does_not_read_is_refused_by_name(tmp_path):
    path = tmp_path / "f16.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="token_embd.weight is stored as F16"):
        gguf_layers(path, random_model(CONFIG, seed=0).config)


@pytest.mark.slow
def test_real_model_blocks_are_the_prepared_weights_and_the_scenario_holds(smollm2):
    model, tok = smollm2
    cfg = model_cfg("smollm2-135m")
    path = gguf_path(cfg.package, cfg.gguf_file)
    embed, layers = gguf_layers(path, model.config)
    hidden = model.config.hidden_size
    a = model.model.layers[0].self_attn
    qkv = quants.dequantize(layers[0]["qkv"][0], Q4_1)
    assert np.array_equal(qkv[:hidden], a.q_proj.weight.detach().numpy())
    assert np.array_equal(qkv[hidden:hidden + a.k_proj.out_features], a.k_proj.weight.detach().numpy())
    assert np.array_equal(quants.dequantize(embed["embed"][0][:100], Q8_0),
                          model.model.embed_tokens.weight[:100].detach().numpy())
    assert {t.tensor_type for t in GGUFReader(str(path)).tensors if t.name.endswith("attn_q.weight")} == {Q4_1}
    net = build_net(model, PrecisionSpec(weights="gguf"), path)
    prompts = scenario_prompts(model, tok)
    ref = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    for policy in (POLICIES[0], POLICIES[4], POLICIES[6]):  # naive, continuous, chunked
        out = run_scenario(net, policy, prompts, LENS, ARRIVE)
        assert agrees(model, prompts, ref, out) == [], policy.name


@pytest.mark.parametrize("level", [PrecisionSpec("w4a8", weights="gguf", activations="int8"),
                                   PrecisionSpec("w8a8", weights="gguf", activations="int8", requantize="q8_0")],
                         ids=["w4a8", "w8a8"])
def test_8_bit_levels_give_a_request_its_tokens_alone_under_every_policy(tiny_gguf, level):
    """x quantized per block, integer sums (engine/kernels/csrc/a8.h): a row's products do not depend on the rows
    beside it, so every policy gives each request the tokens it gets alone; w8a8 holds Q8_0 blocks throughout."""
    model, path = tiny_gguf
    net = build_net(model, level, path)
    assert {f for d in net.products for f in d.fmts} == ({"q8_0"} if level.requantize else {"q4_1", "q8_0"})
    assert all(d.products == [f"{d.fmt}_a8"] * len(d.products) for d in net.products)
    prompts = scenario_prompts(model, None)
    alone = run_scenario(net, POLICIES[0], prompts, LENS, ARRIVE)
    assert alone != run_scenario(build_net(model, PrecisionSpec(weights="gguf"), path), POLICIES[0], prompts, LENS,
                                 ARRIVE)  # lossy: the tiny model's tokens move
    for policy in POLICIES[1:]:
        assert run_scenario(net, policy, prompts, LENS, ARRIVE) == alone, policy.name


def test_activations_and_requantize_need_gguf_weights():
    with pytest.raises(ValueError, match="act on GGUF blocks"):
        PrecisionSpec("x", weights="bf16", activations="int8")
    with pytest.raises(ValueError, match="requantize"):
        PrecisionSpec("x", weights="gguf", requantize="q4_0")
