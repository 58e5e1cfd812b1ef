"""A KV cache in bf16 under fp32 activations (precision=bf16's kv_dtype): checked and sized, K and V rounded to bf16
(nearest even) when written, read back as fp32 exactly, by the fused kernels and by every ATen path alike (the
kernels' own reads and writes: test_attention.py)."""
import pytest
import torch

from engine.factory import build_net
from engine.specs import PrecisionSpec
from pipeline.measuring.accuracy import logits_of


def test_the_cache_dtype_is_checked_and_sized(tiny_llama):
    fp32, bf16 = build_net(tiny_llama), build_net(tiny_llama, PrecisionSpec(kv_dtype="bfloat16"))
    assert fp32.kv_dtype == torch.float32 and bf16.kv_dtype == torch.bfloat16
    assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    with pytest.raises(ValueError, match=r"kv_dtype = 'fp8'.*\['float32', 'bfloat16'\]"):
        build_net(tiny_llama, PrecisionSpec(kv_dtype="fp8"))


def test_every_attention_path_reads_the_same_rounded_cache(tiny):
    """Whole prompts of one length (SDPA over the step's own k, v), prompts of several lengths (the fused kernel in
    place, or ATen's gather), fused or not: each reads K and V as the bf16 cache holds them, so the logits of one
    sequence agree to fp32 summation order, far closer than to an fp32 cache's."""
    name, model = tiny
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (24, 24, 9)]
    runs = {}
    for fused in (True, False):
        net = build_net(model, PrecisionSpec(kv_dtype="bfloat16"), native_kernels=fused)
        runs[f"equal lengths, fused={fused}"] = logits_of(net, seqs[:2])[:23]
        runs[f"mixed lengths, fused={fused}"] = logits_of(net, seqs)[:23]
    fp32 = logits_of(build_net(model), seqs[:2])[:23]
    ref = runs["equal lengths, fused=True"]
    apart = (fp32 - ref).abs().max().item()
    for label, logits in runs.items():
        gap = (logits - ref).abs().max().item()
        assert gap <= apart / 20, f"{name} {label}: {gap} from the others, an fp32 cache {apart}"
