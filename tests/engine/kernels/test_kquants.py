"""GGUF weights whose formats mix (engine/kernels/csrc/quant.h's products; the formats' own kernels: test_quant.py):
parts of different formats make one product (GgufDense in Python, lab.layers' segments natively), a tiny Llama whose
GGUF file mixes all five formats runs at precision=w4 (under every instruction-set build:
tests/engine/kernels/test_builds.py), and the file's rows are read as stored."""
import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from engine.factory import build_net
from engine.kernels import build as native
from engine.model.layers.linear import GgufDense
from engine.specs import PrecisionSpec
from tests.engine.kernels.test_quant import ALL, FORMATS, NEW, assert_product, dequantized, packed, random_blocks

lab = native.ops()
pytestmark = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")


def write_gguf(path, arch: str, tensors: dict) -> None:
    """A GGUF file of `tensors`: name -> (blocks, format)."""
    writer = GGUFWriter(str(path), arch)
    for name, (blocks, fmt) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=FORMATS[fmt][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_parts_of_different_formats_are_one_product():
    """A product whose rows come in five formats: each kernel kind equals x @ W^T, and the per-part products' bits."""
    rng, k = np.random.default_rng(4), 256
    parts = [(f, random_blocks(f, rng, n, k)) for f, n in (("q5_0", 20), ("q8_0", 16), ("q4_k", 5), ("q6_k", 37),
                                                           ("q4_1", 3))]
    bias = torch.randn(81, generator=torch.Generator().manual_seed(4))
    d = GgufDense(tuple(r for _, r in parts), tuple(f for f, _ in parts), k, lab, bias)
    assert d.shape == (k, 81) and d.candidates[1] == "q5_0_tiles+q8_0_tiles+q4_k_tiles+q6_k_tiles+q4_1_tiles"
    assert d.weight_bytes == sum(r.nbytes for _, r in parts)
    wd = torch.cat([dequantized(f, r) for f, r in parts]).double()
    x, res = torch.randn(6, k, dtype=torch.float32), torch.randn(6, 81)
    for name, kind in zip(d.candidates, ALL):
        y = d.product(name, x, res)
        assert_product(y, x.double(), wd, bias, res)
        cols = np.cumsum([0] + [len(r) for _, r in parts])
        each = [getattr(lab, f"{f}{kind}_linear")(x, packed(f, r), bias[a:b], res[:, a:b])
                for (f, r), a, b in zip(parts, cols, cols[1:])]
        assert torch.equal(y, torch.cat(each, 1))
        with pytest.raises(KeyError):  # only its own candidates: the chooser groups a family apart
            d.product(name.split("+")[0], x, res)
    kind, w, table, _ = d.lab_args(0)
    assert native.PRODUCTS[kind] == "segments" and w.dim() == 1 and table[:, 1].tolist() == [20, 16, 5, 37, 3]


CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "rope_theta": 10000.0, "initializer_range": 0.05, "tie_word_embeddings": True, "bos_token_id": 1,
          "eos_token_id": 2}
MIX = [{"attn_q": "q5_0", "attn_k": "q8_0", "attn_v": "q5_0", "attn_output": "q4_k", "ffn_gate": "q5_0",
        "ffn_up": "q4_k", "ffn_down": "q6_k"},
       {"attn_q": "q5_0", "attn_k": "q5_0", "attn_v": "q8_0", "attn_output": "q4_k", "ffn_gate": "q4_1",
        "ffn_up": "q4_1", "ffn_down": "q4_k"}]  # each layer's formats, as a Q4_K_M file mixes them


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """(a tiny Llama holding the dequantized values of random blocks, the GGUF file of those blocks)."""
    from engine.model.loader import random_model
    from tests.engine.model.test_w4 import llama_cpp_order

    model, rng, tensors = random_model(CONFIG, seed=5), np.random.default_rng(5), {}

    def store(name, param, fmt, heads=None):
        blocks = random_blocks(fmt, rng, *param.shape)
        with torch.no_grad():
            param.copy_(dequantized(fmt, blocks))
        tensors[name] = (llama_cpp_order(blocks, heads) if heads else blocks), fmt

    store("token_embd.weight", model.model.embed_tokens.weight, "q8_0")
    for i, layer in enumerate(model.model.layers):
        a, m, b = layer.self_attn, layer.mlp, f"blk.{i}."
        for name, lin in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj), ("attn_output", a.o_proj),
                          ("ffn_gate", m.gate_proj), ("ffn_up", m.up_proj), ("ffn_down", m.down_proj)):
            heads = {"attn_q": CONFIG["num_attention_heads"], "attn_k": CONFIG["num_key_value_heads"]}.get(name)
            store(b + name + ".weight", lin.weight, MIX[i][name], heads)
    path = tmp_path_factory.mktemp("kquants") / "mixed.gguf"
    write_gguf(path, "llama", tensors)
    return model, path


def test_a_file_mixing_every_format_runs_at_w4(mixed_gguf):
    """The qkv and gate/up products of parts in different formats, natively (lab.layers' segments) and in Python; the
    tokens equal generate's on the dequantized values up to near-ties."""
    from engine.model.hf import generate_alone
    from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, run_scenario, scenario_prompts
    from tests.engine.model.test_w4 import agrees

    model, path = mixed_gguf
    net = build_net(model, PrecisionSpec(weights="gguf"), path)
    layer = net.layers[0]
    assert (layer.qkv.fmt, layer.gate_up.fmt, net.layers[1].qkv.fmt) == ("q5_0+q8_0+q5_0", "q5_0+q4_k", "q5_0+q8_0")
    assert native.PRODUCTS[layer.qkv.lab_args(0)[0]] == "segments"
    prompts = scenario_prompts(model, None)
    ref = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    for policy in (POLICIES[0], POLICIES[4]):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = run_scenario(net, policy, prompts, LENS, ARRIVE)
        assert agrees(model, prompts, ref, out) == [], policy.name
        names = {e.name for e in prof.events()}  # every layer in one native call, its K-quant products inside
        assert "lab::layers" in names and all(any(n.startswith(f"lab::{f}") for n in names) for f in NEW)


def test_gemma3_rows_are_read_as_stored(tmp_path):
    """llama.cpp stores Gemma 3's q/k rows in Hugging Face's order: read as they are (a Llama's are un-permuted)."""
    from types import SimpleNamespace

    from engine.model.gguf import gguf_layers
    from engine.model.models.gemma3 import Gemma3

    rng, path = np.random.default_rng(7), tmp_path / "gemma.gguf"
    shapes = {"token_embd": (64, 256, "q8_0"), "attn_q": (64, 256, "q4_k"), "attn_k": (32, 256, "q4_k"),
              "attn_v": (32, 256, "q8_0"), "attn_output": (256, 512, "q4_k"), "ffn_gate": (128, 256, "q5_0"),
              "ffn_up": (128, 256, "q5_0"), "ffn_down": (256, 128, "q5_0")}  # out, in, format
    stored = {name: (random_blocks(fmt, rng, n, k), fmt) for name, (n, k, fmt) in shapes.items()}
    write_gguf(path, "gemma3", {(n if n == "token_embd" else f"blk.0.{n}") + ".weight": v for n, v in stored.items()})
    config = SimpleNamespace(model_type="gemma3_text", num_attention_heads=2, num_key_value_heads=1,
                             num_hidden_layers=1)
    _, (layer,) = gguf_layers(path, config, Gemma3.gguf_permuted)
    blocks, fmts, k = layer["qkv"]  # parts of two formats
    assert fmts == ("q4_k", "q4_k", "q8_0") and k == 256
    assert all(np.array_equal(b, stored[n][0]) for b, n in zip(blocks, ("attn_q", "attn_k", "attn_v")))
    _, (llama,) = gguf_layers(path, config)
    assert not np.array_equal(llama["qkv"][0][0], stored["attn_q"][0])  # a Llama's rows are un-permuted


def test_an_embedding_not_in_q8_0_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from engine.model.gguf import gguf_layers

    path = tmp_path / "embed.gguf"
    write_gguf(path, "llama", {"token_embd.weight": (random_blocks("q4_k", np.random.default_rng(0), 8, 256), "q4_k")})
    config = SimpleNamespace(model_type="llama", num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(ValueError, match="token_embd.weight is stored as Q4_K"):
        gguf_layers(path, config)
