"""The Q5_0, Q4_K and Q6_K kernels (engine/kernels/csrc/quant.h) on synthetic GGUF blocks: every kernel's weights
are gguf's dequantization to the bit, its products equal x @ W^T to fp32 rounding whatever the shapes, tails and
rows, a row's bits the same alone or among others; a block misread at any field (d for dmin, the scale packing, a qh
bit off...) fails these comparisons; parts of different formats make one product (GgufDense in Python, lab.layers'
segments natively), and a tiny Llama whose GGUF file mixes all five formats runs at precision=w4 (under every
instruction-set build: tests/engine/kernels/test_builds.py)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from engine.kernels import build as native
from engine.model.linear import GgufDense
from tests.engine.kernels.test_quant import assert_product

lab = native.ops()
pytestmark = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")
FORMATS = {"q4_k": (Q.Q4_K, 256, 144, (0, 2), 1e-4), "q5_0": (Q.Q5_0, 32, 22, (0,), 5e-3),
           "q6_k": (Q.Q6_K, 256, 210, (208,), 1e-5), "q8_0": (Q.Q8_0, 32, 34, (0,), 1e-3),
           "q4_1": (Q.Q4_1, 32, 20, (0, 2), 1e-2)}  # type, weights and bytes a block, its fp16 fields, their range
NEW = ["q4_k", "q5_0", "q6_k"]
SHAPES = {"q4_k": [(37, 512), (16, 256)], "q5_0": [(37, 640), (5, 96)], "q6_k": [(37, 768), (130, 256)]}  # N, K
KERNELS = ["", "_tiles", "_mm"]  # per row of x, dequantized tiles, ATen's GEMM


def random_blocks(fmt, rng, n, k):
    """Raw blocks [n, k/QK * B]: random bytes, the fp16 fields random finite scales (weights of |w| < 0.2)."""
    _, qk, size, halves, scale = FORMATS[fmt]
    raw = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
    for off in halves:
        d = rng.uniform(-scale, scale, (n, k // qk)).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def dequantized(fmt, raw):
    return torch.from_numpy(quants.dequantize(raw, FORMATS[fmt][0]).reshape(len(raw), -1))


def packed(fmt, raw):
    return getattr(lab, f"{fmt}_pack")(torch.from_numpy(raw))


def write_gguf(path, arch: str, tensors: dict) -> None:
    """A GGUF file of `tensors`: name -> (blocks, format)."""
    writer = GGUFWriter(str(path), arch)
    for name, (blocks, fmt) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=FORMATS[fmt][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", NEW)
def test_every_kernel_holds_what_gguf_reads(fmt, kernel):
    """x one-hot gives each kernel's weights back: gguf's dequantization to the bit, a partial last tile included."""
    for n, k in SHAPES[fmt]:
        raw = random_blocks(fmt, np.random.default_rng(n), n, k)
        y = getattr(lab, f"{fmt}{kernel}_linear")(torch.eye(k), packed(fmt, raw), None, None)
        assert torch.equal(y, dequantized(fmt, raw).T.contiguous())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", NEW)
def test_products_equal_the_dequantized_product(fmt, kernel):
    for n, k in SHAPES[fmt]:
        raw = random_blocks(fmt, np.random.default_rng(n * k), n, k)
        w, wd, linear = packed(fmt, raw), dequantized(fmt, raw).double(), getattr(lab, f"{fmt}{kernel}_linear")
        g = torch.Generator().manual_seed(k)
        for t in (1, 3, 8, 64):
            x = torch.randn(t, k + 16, generator=g)[:, 8:k + 8]  # rows strided
            bias, residual = torch.randn(n, generator=g), torch.randn(t, 2 * n, generator=g)[:, :n]
            assert_product(linear(x, w, None, None), x.double(), wd)
            assert_product(linear(x, w, bias, residual), x.double(), wd, bias, residual)


@pytest.mark.parametrize("kernel", KERNELS[:2])
@pytest.mark.parametrize("fmt", NEW)
def test_a_row_is_the_same_bits_alone_or_among_others(fmt, kernel):
    n, k = SHAPES[fmt][0]
    w, linear = packed(fmt, random_blocks(fmt, np.random.default_rng(1), n, k)), getattr(lab, f"{fmt}{kernel}_linear")
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(2))
    together = linear(x, w, None, None)
    for i in (0, 1, 5, 17):
        assert torch.equal(linear(x[i:i + 1], w, None, None), together[i:i + 1])
        assert torch.equal(linear(x[i:i + 3], w, None, None), together[i:i + 3])


def _swap(a, b):  # bytes [a0, a1) and [b0, b1) of each block exchanged
    def f(r):
        r[..., a[0]:a[1]], r[..., b[0]:b[1]] = r[..., b[0]:b[1]].copy(), r[..., a[0]:a[1]].copy()
    return f


def _nibbles(lo, hi):  # the two nibbles of bytes [lo, hi) exchanged
    def f(r):
        r[..., lo:hi] = r[..., lo:hi] << 4 | r[..., lo:hi] >> 4
    return f


def _top_bits(a, b):  # bits 6-7 of bytes [a, a + 4) and [b, b + 4) exchanged
    def f(r):
        ta, tb = r[..., a:a + 4] & 0xC0, r[..., b:b + 4] & 0xC0
        r[..., a:a + 4], r[..., b:b + 4] = r[..., a:a + 4] & 0x3F | tb, r[..., b:b + 4] & 0x3F | ta
    return f


def _rotate(lo, hi, bits):  # each byte of [lo, hi) rotated left by `bits`
    def f(r):
        r[..., lo:hi] = r[..., lo:hi] << bits | r[..., lo:hi] >> (8 - bits)
    return f


def _qh_off_by_one(r):  # Q5_0's 32 high bits read one place off
    qh = r[..., 2:6].copy().view(np.uint32)
    r[..., 2:6] = (qh << 1 | qh >> 31).view(np.uint8)


MISREADINGS = {  # format -> a misreading of its blocks' fields, as the bytes a correct reader would read instead
    "q4_k": {"d and dmin swapped": _swap((0, 2), (2, 4)), "scales read as mins": _swap((4, 8), (8, 12)),
             "scales 4-7 read from the first bytes": _swap((4, 8), (12, 16)),
             "scales' high bits from the mins' bytes": _top_bits(4, 8),
             "scales 4-7's nibbles swapped": _nibbles(12, 16), "a sub-block's nibbles swapped": _nibbles(16, 48),
             "sub-blocks out of order": _swap((16, 48), (48, 80))},
    "q5_0": {"d read from qh": _swap((0, 2), (2, 4)), "qh a bit off": _qh_off_by_one,
             "nibbles swapped": _nibbles(6, 22), "the codes read from qh's place": _swap((2, 6), (6, 10))},
    "q6_k": {"ql halves swapped": _swap((0, 64), (64, 128)), "qh a bit pair off": _rotate(128, 192, 2),
             "qh halves swapped": _swap((128, 160), (160, 192)), "ql nibbles swapped": _nibbles(0, 128),
             "scales out of order": _swap((192, 200), (200, 208)),
             "d read from the scales": _swap((192, 194), (208, 210))},
}


@pytest.mark.parametrize("fmt", NEW)
def test_a_field_misread_fails_the_comparisons(fmt):
    """The tests above would catch a kernel misreading any field: the values such a kernel gives (gguf's of the bytes
    it would in effect read) fail both the bit comparison and the product's tolerance."""
    n, k = SHAPES[fmt][0]
    raw = random_blocks(fmt, np.random.default_rng(9), n, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9))
    w = packed(fmt, raw)
    weights = getattr(lab, f"{fmt}_tiles_linear")(torch.eye(k), w, None, None).T
    y = getattr(lab, f"{fmt}_linear")(x, w, None, None)
    assert torch.equal(weights, dequantized(fmt, raw))
    for name, misread in MISREADINGS[fmt].items():
        wrong = raw.reshape(n, -1, FORMATS[fmt][2]).copy()
        misread(wrong)
        with np.errstate(invalid="ignore"):  # a scale read from codes may be NaN: failing the comparisons too
            wrong = dequantized(fmt, wrong.reshape(n, -1))
        assert not torch.equal(weights, wrong), name
        with pytest.raises(AssertionError):
            assert_product(y, x.double(), wrong.double())


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
    for name, kind in zip(d.candidates, KERNELS):
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
    from engine.model.forward import FlatModel
    from engine.model.hf import generate_alone
    from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, run_scenario, scenario_prompts
    from tests.engine.model.test_w4 import agrees

    model, path = mixed_gguf
    net = FlatModel(model, weights="gguf", gguf=path)
    layer = net.layers[0]
    assert (layer.qkv.fmt, layer.gate_up.fmt, net.layers[1].qkv.fmt) == ("q5_0+q8_0+q5_0", "q5_0+q4_k", "q5_0+q8_0")
    assert native.PRODUCTS[layer.qkv.lab_args(0)[0]] == "segments"
    prompts = scenario_prompts(model, None)
    ref = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    for policy in (POLICIES[0], POLICIES[4]):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = run_scenario(net, policy, prompts, LENS, ARRIVE)
        assert agrees(model, prompts, ref, out) == [], policy["name"]
        names = {e.name for e in prof.events()}  # every layer in one native call, its K-quant products inside
        assert "lab::layers" in names and all(any(n.startswith(f"lab::{f}") for n in names) for f in NEW)


def test_gemma3_rows_are_read_as_stored(tmp_path):
    """llama.cpp stores Gemma 3's q/k rows in Hugging Face's order: read as they are (a Llama's are un-permuted)."""
    from types import SimpleNamespace

    from engine.model.gguf import gguf_layers

    rng, path = np.random.default_rng(7), tmp_path / "gemma.gguf"
    shapes = {"token_embd": (64, 256, "q8_0"), "attn_q": (64, 256, "q4_k"), "attn_k": (32, 256, "q4_k"),
              "attn_v": (32, 256, "q8_0"), "attn_output": (256, 512, "q4_k"), "ffn_gate": (128, 256, "q5_0"),
              "ffn_up": (128, 256, "q5_0"), "ffn_down": (256, 128, "q5_0")}  # out, in, format
    stored = {name: (random_blocks(fmt, rng, n, k), fmt) for name, (n, k, fmt) in shapes.items()}
    write_gguf(path, "gemma3", {(n if n == "token_embd" else f"blk.0.{n}") + ".weight": v for n, v in stored.items()})
    config = SimpleNamespace(model_type="gemma3_text", num_attention_heads=2, num_key_value_heads=1,
                             num_hidden_layers=1)
    _, (layer,) = gguf_layers(path, config)
    blocks, fmts, k = layer["qkv"]  # parts of two formats
    assert fmts == ("q4_k", "q4_k", "q8_0") and k == 256
    assert all(np.array_equal(b, stored[n][0]) for b, n in zip(blocks, ("attn_q", "attn_k", "attn_v")))
    _, (llama,) = gguf_layers(path, SimpleNamespace(**{**vars(config), "model_type": "llama"}))
    assert not np.array_equal(llama["qkv"][0][0], stored["attn_q"][0])  # a Llama's rows are un-permuted


def test_an_embedding_not_in_q8_0_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from engine.model.gguf import gguf_layers

    path = tmp_path / "embed.gguf"
    write_gguf(path, "llama", {"token_embd.weight": (random_blocks("q4_k", np.random.default_rng(0), 8, 256), "q4_k")})
    config = SimpleNamespace(model_type="llama", num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(ValueError, match="token_embd.weight is stored as Q4_K"):
        gguf_layers(path, config)
