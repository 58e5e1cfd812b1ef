"""precision=bf16's CPU product (engine/kernels/csrc/bf16.cpp: vdpbf16ps on a CPU with AVX512-BF16, the pairs widened
and summed with FMA in every other build: tests/engine/kernels/test_builds.py runs this file under each): x rounded to
bf16 (nearest even), times the bf16 weight, summed in fp32, equals the same product in float64 to fp32 rounding of each
sum, whatever the shapes (tiles whole and partial), the number of rows, strided x, bias and residual; a row does not
depend on the rows beside it; the norm and SiLU x up that feed it already rounded give the very same bits."""
import pytest
import torch

from engine.kernels import build as native

lab = native.ops()
pytestmark = pytest.mark.skipif(lab is None, reason="no fused kernels")


def reference(x, w, bias=None, residual=None):
    """(x and w rounded to bf16, then x @ w.T + bias + residual in float64, and the sum of the terms' magnitudes)."""
    xb, wb = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    want, scale = xb @ wb.T, xb.abs() @ wb.abs().T
    for extra in (bias, residual):
        if extra is not None:
            want, scale = want + extra.double(), scale + extra.double().abs()
    return want, scale


@pytest.mark.parametrize("op", ["bf16_linear", "bf16_tiles_linear", "bf16_mm_linear"])
@pytest.mark.parametrize("n,k", [(16, 32), (20, 64), (37, 576), (80, 96), (130, 1536), (5, 2)])
def test_bf16_linear_equals_the_rounded_product(n, k, op):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    packed = lab.bf16_pack(w)
    for t in (1, 2, 5, 6, 7, 8, 9, 11, 64):  # a kernel's rows (8; widened 6 or 5) whole, partial and over
        x = torch.randn(t, k + 16, generator=g)[:, 8:k + 8]  # rows strided
        bias, residual = torch.randn(n, generator=g), torch.randn(t, 2 * n, generator=g)[:, :n]
        for args in ((None, None), (bias, residual)):
            y = getattr(lab, op)(x, packed, n, *args)
            want, scale = reference(x, w, *args)
            assert y.dtype == torch.float32 and y.shape == (t, n)
            assert ((y.double() - want).abs() / (scale + 1e-30)).max().item() < 2e-6


def test_a_row_is_the_same_bits_alone_or_among_others():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 576, generator=g), torch.randn(64, 576, generator=g)
    packed = lab.bf16_pack(w)
    together = lab.bf16_linear(x, packed, 100, None, None)
    for i in (0, 5, 63):
        assert torch.equal(lab.bf16_linear(x[i:i + 1], packed, 100, None, None), together[i:i + 1])


@pytest.mark.parametrize("t,k", [(1, 576), (7, 96), (64, 576), (64, 1536)])
def test_inputs_rounded_by_the_norm_or_silu_give_the_same_bits(t, k):
    g = torch.Generator().manual_seed(t + k)
    w, x = torch.randn(48, k, generator=g), torch.randn(t, k + 8, generator=g)[:, 4:k + 4]  # x strided
    ln, gu = torch.rand(k, generator=g) + 0.5, torch.randn(t, 2 * k, generator=g)
    packed = lab.bf16_pack(w)
    for fp32, rounded in ((lab.rms_norm(x, ln, 1e-5), lab.bf16_rms_norm(x, ln, 1e-5)),
                          (lab.silu_mul(gu), lab.bf16_silu_mul(gu))):
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, fp32.bfloat16())
        product = lab.bf16_linear(rounded, packed, 48, None, None)
        assert torch.equal(product, lab.bf16_linear(fp32, packed, 48, None, None))
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        lab.bf16_linear(torch.zeros(4, 2 * k, dtype=torch.bfloat16)[:, :k], packed, 48, None, None)


def test_x_rounds_to_nearest_even_with_subnormals_as_zeros():
    """x times an identity weight gives x as rounded: ties to even, subnormals (below 2^-126) as zeros (AVX512-BF16's
    conversion, in every build)."""
    x = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-9), 3e38, 1e-39, -1e-39, 1 + 2**-7, -0.0,
                       2.0**-126, 1.1, -7.3, 0.0, 65504.0, 1e-20, 1.0, -2.5e-38]])
    y = lab.bf16_linear(x, lab.bf16_pack(torch.eye(16)), 16, None, None)
    want = x.bfloat16().float()
    want[0, 4:6] = 0.0
    assert torch.equal(y, want)
    assert y[0, 0] == 1.0 and y[0, 1] == 1 + 2**-6 and y[0, 15] != 0


@pytest.mark.parametrize("n,k", [(130, 1536), (37, 576), (16, 32), (5, 2)])
def test_the_tiles_kernel_gives_the_same_bits(n, k):
    """bf16_tiles_linear (tiles widened into cache, an fp32 FMA kernel) sums in bf16_linear's order: the same bits,
    x in fp32 or already rounded, whatever the rows."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    packed = lab.bf16_pack(w)
    for t in (1, 5, 6, 7, 64, 300):
        x = torch.randn(t, k + 8, generator=g)[:, 4:k + 4]
        bias, residual = torch.randn(n, generator=g), torch.randn(t, n, generator=g)
        for args in ((None, None), (bias, residual)):
            assert torch.equal(lab.bf16_tiles_linear(x, packed, n, *args), lab.bf16_linear(x, packed, n, *args))
        xb = x.contiguous().bfloat16()
        assert torch.equal(lab.bf16_tiles_linear(xb, packed, n, None, None), lab.bf16_linear(xb, packed, n, None, None))
