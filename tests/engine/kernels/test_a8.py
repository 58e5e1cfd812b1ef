"""The 8-bit products (engine/kernels/csrc/a8.h, precision levels w4a8 and w8a8): x quantized per block as llama.cpp
quantizes activations (Q8_1 for Q4_1, Q8_0 for Q8_0 and Q5_0, Q8_K for Q4_K and Q6_K), integer sums, fp32 scaling.
Each format's product equals a float64 reference built here from the same rules (gguf's dequantized weights times
the quantized x, Q4_1's minima times Q8_1's fp16 s), a row is the same bits alone or among others, a non-finite
activation gives NaN in its rows only, and Q8_0's 8-bit packing reads back as gguf's rows (under every
instruction-set build: tests/engine/kernels/test_builds.py)."""
import numpy as np
import pytest
import torch

from engine.kernels import build as native
from tests.engine.kernels.test_quant import FORMATS, dequantized, q4_1_blocks, random_blocks

lab = native.ops()
pytestmark = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")
ACT = {"q4_1": "q8_1", "q8_0": "q8_0", "q5_0": "q8_0", "q4_k": "q8_k", "q6_k": "q8_k"}  # llama.cpp's vec_dot_type
F32 = np.float32


def quantized(x: np.ndarray, act: str):
    """x [T, K] float32 -> (codes [T, K/n, n], d [T, K/n], s [T, K/n]) as llama.cpp's x86 quantize_row_q8_* gives."""
    n = 256 if act == "q8_k" else 32
    b = x.reshape(len(x), -1, n)
    amax = np.abs(b).max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if act == "q8_k":
            big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]  # the first largest |x|
            iscale = F32(-127) / big
            q = np.minimum(127, np.rint(iscale[..., None] * b))
            d = np.where(amax == 0, F32(0), F32(1) / iscale)
        else:
            q = np.rint(b * (F32(127) / amax)[..., None])
            d = (amax / F32(127)).astype(np.float16).astype(F32)
        q = np.where(amax[..., None] == 0, 0, q).astype(np.int8)
    s = (amax / F32(127) * q.astype(np.int32).sum(-1).astype(F32)).astype(np.float16).astype(F32)
    return q, d, s


def reference(fmt: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [T, K] times the weights of `raw` [N, K/QK * B] under the level's arithmetic, in float64: sum over x's
    blocks of d_x sum(w q_x), w gguf's dequantized weight; Q4_1's as llama.cpp: d_w d_x sum(q_w q_x) + m_w s_x."""
    q, d, s = quantized(x, ACT[fmt])
    n = len(raw)
    if fmt == "q4_1":
        blocks = raw.reshape(n, -1, 20)
        dw = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
        mw = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        codes = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], -1).astype(np.float64)  # [n, Kb, 32]
        sums = np.einsum("nbk,tbk->tnb", codes, q.astype(np.float64))
        return (np.einsum("nb,tb,tnb->tn", dw, d.astype(np.float64), sums)
                + np.einsum("nb,tb->tn", mw, s.astype(np.float64)))
    w = dequantized(fmt, raw).numpy().astype(np.float64).reshape(n, -1, q.shape[2])
    return np.einsum("nbk,tbk,tb->tn", w, q.astype(np.float64), d.astype(np.float64))


def weights(fmt, rng, n, k):
    return q4_1_blocks(rng, n, k)[0] if fmt == "q4_1" else random_blocks(fmt, rng, n, k)


def product(fmt, raw, x, bias=None, residual=None):
    w = getattr(lab, f"{fmt}_a8_pack")(torch.from_numpy(raw))
    return getattr(lab, f"{fmt}_a8_linear")(x, w, bias, residual)


@pytest.mark.parametrize("fmt", list(ACT))
@pytest.mark.parametrize("n,rows", [(37, 1), (16, 5), (48, 9)])
def test_each_format_equals_the_reference(fmt, n, rows):
    """Tails of tiles and of row groups; bias and residual added; a code or scale off anywhere exceeds the bound."""
    rng, k = np.random.default_rng(n * rows), 512
    raw = weights(fmt, rng, n, k)
    x = rng.normal(0, 1, (rows, k)).astype(F32)
    x[0, :32] *= 1e-3  # a block of small values: its own scale
    bias, res = torch.randn(n), torch.randn(rows, n)
    y = product(fmt, raw, torch.from_numpy(x), bias, res).double()
    want = reference(fmt, raw, x) + bias.double().numpy() + res.double().numpy()
    scale = np.abs(dequantized(fmt, raw).numpy()).astype(np.float64) @ np.abs(x.T).astype(np.float64)
    assert np.all(np.abs(y.numpy() - want) <= 5e-7 * scale.T + 1e-5), fmt


@pytest.mark.parametrize("fmt", list(ACT))
def test_the_largest_integer_sums_are_exact(fmt):
    """Every code byte 0xFF (the largest codes, scales and minima) times x's codes all 127 or all -127: the integer
    sums at their bounds (Q4_1's and Q4_K's in int16 pairs where the build lacks VNNI) still equal the reference."""
    _, _, size, halves, _ = FORMATS[fmt]
    raw = weights(fmt, np.random.default_rng(5), 24, 512).reshape(24, -1, size)
    fields = np.ones(size, bool)
    for off in halves:
        fields[off:off + 2] = False
    raw[..., fields] = 0xFF
    raw = raw.reshape(24, -1)
    x = np.repeat(np.array([[1], [-1], [3]], F32), 512, 1)
    x[2, ::2] = -3  # codes +-127 alternating
    y = product(fmt, raw, torch.from_numpy(x)).double().numpy()
    want = reference(fmt, raw, x)
    scale = np.abs(dequantized(fmt, raw).numpy()).astype(np.float64) @ np.abs(x.T).astype(np.float64)
    assert np.all(np.abs(y - want) <= 5e-7 * scale.T + 1e-5), fmt


@pytest.mark.parametrize("fmt", list(ACT))
def test_a_row_is_the_same_bits_alone_or_among_others(fmt):
    rng, k = np.random.default_rng(7), 256
    raw = weights(fmt, rng, 40, k)
    x = torch.from_numpy(rng.normal(0, 1, (11, k)).astype(F32))
    together = product(fmt, raw, x)
    for t in (0, 5, 10):
        assert torch.equal(product(fmt, raw, x[t:t + 1]), together[t:t + 1])
    assert torch.equal(product(fmt, raw, x[::2]), together[::2])  # strided rows


@pytest.mark.parametrize("fmt", ["q4_1", "q4_k"])
def test_zero_and_non_finite_activations(fmt):
    """A zero block adds nothing; a NaN or infinity makes its row NaN and leaves the other rows alone."""
    rng, k = np.random.default_rng(3), 256
    raw = weights(fmt, rng, 20, k)
    x = torch.from_numpy(rng.normal(0, 1, (3, k)).astype(F32))
    x[0] = 0
    x[1, 17], x[2, 100] = float("nan"), float("inf")
    y = product(fmt, raw, x)
    assert torch.equal(y[0], torch.zeros(20))
    assert torch.isnan(y[1:]).all()


def test_q8_0_rows_of_the_8_bit_packing_are_gguf_rows():
    rng = np.random.default_rng(5)
    raw = random_blocks("q8_0", rng, 37, 96)
    ids = torch.tensor([0, 36, 17, 16, 15])
    rows = lab.q8_0_a8_rows(lab.q8_0_a8_pack(torch.from_numpy(raw)), ids)
    assert torch.equal(rows, dequantized("q8_0", raw)[ids])


def test_arguments_are_checked():
    raw = random_blocks("q8_0", np.random.default_rng(1), 16, 64)
    w = lab.q8_0_a8_pack(torch.from_numpy(raw))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        lab.q8_0_a8_linear(torch.randn(2, 48), w, None, None)
