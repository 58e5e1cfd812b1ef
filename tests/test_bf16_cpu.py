"""precision=bf16's CPU product (engine/kernels/csrc/bf16.cpp, in AVX-512 builds on a CPU with AVX512-BF16): x rounded
to bf16 (nearest even), times the bf16 weight, summed in fp32, equals the same product in float64 to fp32 rounding of
each sum, whatever the shapes (tiles whole and partial), the number of rows, strided x, bias and residual; a row does
not depend on the rows beside it; the norm and SiLU x up that feed it already rounded give the very same bits."""
import pytest
import torch

from engine.kernels import build as native

lab = native.ops()
pytestmark = pytest.mark.skipif(lab is None or not native.capabilities()["bf16_dot"],
                                reason="no fused kernels, or no AVX512-BF16 in this build or CPU")


def reference(x, w, bias=None, residual=None):
    """(x and w rounded to bf16, then x @ w.T + bias + residual in float64, and the sum of the terms' magnitudes)."""
    xb, wb = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    want, scale = xb @ wb.T, xb.abs() @ wb.abs().T
    for extra in (bias, residual):
        if extra is not None:
            want, scale = want + extra.double(), scale + extra.double().abs()
    return want, scale


@pytest.mark.parametrize("n,k", [(16, 32), (20, 64), (37, 576), (80, 96), (130, 1536), (5, 2)])
def test_bf16_linear_equals_the_rounded_product(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    packed = lab.bf16_pack(w)
    for t in (1, 2, 5, 7, 8, 9, 64):  # a kernel's rows (8) whole, partial and over
        x = torch.randn(t, k + 16, generator=g)[:, 8:k + 8]  # rows strided
        bias, residual = torch.randn(n, generator=g), torch.randn(t, 2 * n, generator=g)[:, :n]
        for args in ((None, None), (bias, residual)):
            y = lab.bf16_linear(x, packed, n, *args)
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
