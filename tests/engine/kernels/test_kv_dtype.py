"""A KV cache in bf16 under fp32 activations (precision=bf16's kv_dtype): K and V rounded to bf16 (nearest even) when
written, read back as fp32 exactly, by the fused kernels and by every ATen path alike."""
import pytest
import torch

from engine.kernels import build as native
from engine.model.forward import FlatModel
from pipeline.measuring.accuracy import logits_of

lab = native.ops()
needs_lab = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")


@needs_lab
@pytest.mark.parametrize("D", [64, 16, 24])  # whole vectors, one vector, and the any-head-dim path
def test_attention_reads_a_bf16_cache_as_its_fp32_values(D):
    """The same sums of the same products as over an fp32 cache holding those values: the very bits where rows are
    read in order, within fp32 rounding where a bf16 row is read evens and odds apart (AVX-512, whole pairs of
    vectors: the scores add in another order; a value misread is off by its own size); one key alone gives its value
    row exactly."""
    g = torch.Generator().manual_seed(D)
    S, H, KV, L = 5, 6, 2, 37
    q = torch.randn(S, H, D, generator=g)
    k, v = (torch.randn(S, KV, L, D, generator=g).bfloat16() for _ in range(2))
    bias = torch.zeros(S, L)
    bias[1, 3], bias[2, 10:] = -torch.inf, -torch.inf
    split = D % 32 == 0 and native.capabilities()["isa"] == "AVX512"  # rows read evens and odds apart

    def same(a, b):  # read in order: the very bits; split: fp32 sums in another order
        if split:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(a, b)

    got = lab.decode_attention(q, k, v, bias, 0.3)
    same(got, lab.decode_attention(q, k.float(), v.float(), bias, 0.3))
    one = lab.decode_attention(q, k[:, :, :1], v[:, :, :1], None, 0.3)
    assert torch.equal(one, v[:, :, :1].float().repeat_interleave(H // KV, dim=1).squeeze(2))
    spans = torch.tensor([[0, 0, 5], [1, 2, 30], [4, 0, 37]])
    got = lab.token_attention(q[:3], k, v, spans, None, 0.3)
    same(got, lab.token_attention(q[:3], k.float(), v.float(), spans, None, 0.3))


@needs_lab
def test_writes_round_to_nearest_even_and_dtypes_are_checked():
    src = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)) * 1e3
    dst = torch.zeros(10, 64, dtype=torch.bfloat16)
    rows = torch.tensor([9, 0, 4, 2, 3, 7])
    lab.write_rows_(dst, rows, src)
    assert torch.equal(dst[rows], src.reshape(6, 64).bfloat16())
    assert not dst[[1, 5, 6, 8]].any()
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match="k and v of one dtype"):
        lab.decode_attention(q, k.bfloat16(), k, None, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        lab.decode_attention(q, k.half(), k.half(), None, 1.0)


def test_the_cache_dtype_is_checked_and_sized(tiny_llama):
    fp32, bf16 = FlatModel(tiny_llama), FlatModel(tiny_llama, kv_dtype="bfloat16")
    assert fp32.kv_dtype == torch.float32 and bf16.kv_dtype == torch.bfloat16
    assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    with pytest.raises(ValueError, match=r"kv_dtype 'fp8'.*\['float32', 'bfloat16'\]"):
        FlatModel(tiny_llama, kv_dtype="fp8")


def test_every_attention_path_reads_the_same_rounded_cache(tiny):
    """Whole prompts of one length (SDPA over the step's own k, v), prompts of several lengths (the fused kernel in
    place, or ATen's gather), fused or not: each reads K and V as the bf16 cache holds them, so the logits of one
    sequence agree to fp32 summation order, far closer than to an fp32 cache's."""
    name, model = tiny
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (24, 24, 9)]
    runs = {}
    for fused in (True, False):
        net = FlatModel(model, native_kernels=fused, kv_dtype="bfloat16")
        runs[f"equal lengths, fused={fused}"] = logits_of(net, seqs[:2])[:23]
        runs[f"mixed lengths, fused={fused}"] = logits_of(net, seqs)[:23]
    fp32 = logits_of(FlatModel(model), seqs[:2])[:23]
    ref = runs["equal lengths, fused=True"]
    apart = (fp32 - ref).abs().max().item()
    for label, logits in runs.items():
        gap = (logits - ref).abs().max().item()
        assert gap <= apart / 20, f"{name} {label}: {gap} from the others, an fp32 cache {apart}"
