"""check_precision's figures (pipeline.measuring.accuracy) against the definitions computed directly in fp64: KL
divergence, top-1 agreement, near-ties and the stream's negative log-likelihoods, over more positions than one
block of rows; identical logits give a divergence of exactly zero; lossless is decided against the floor."""
import pytest
import torch

from pipeline.measuring import accuracy


def test_compare_matches_the_definitions_across_row_blocks():
    g = torch.Generator().manual_seed(0)
    P, V = accuracy.ROWS + 37, 300
    ref = torch.randn(P, V, generator=g) * 4
    ref[3, :2] = ref[3].max() + torch.tensor([1.0, 1.0 - 1e-4])  # a near-tie of the reference's top two
    got = ref + torch.randn(P, V, generator=g) * 0.05
    targets = torch.randint(0, V, (P,), generator=g)
    c = accuracy.compare(ref, {"got": got, "same": ref.clone()}, targets)

    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    assert torch.allclose(c["got"]["kld"], kld, rtol=1e-9, atol=1e-15)
    assert torch.equal(c["got"]["top1"], ref.argmax(-1) == got.argmax(-1))
    assert not c["got"]["top1"].all()  # the noise flips some positions: the check can fail
    top2 = ref.double().topk(2, dim=-1).values
    assert torch.equal(c["got"]["tie"], top2[:, 0] - top2[:, 1] < accuracy.TIE) and c["got"]["tie"][3]
    assert torch.allclose(c["got"]["nll_ref"], -lp.gather(1, targets[:, None])[:, 0], rtol=1e-12)
    assert torch.allclose(c["got"]["nll_got"], -lq.gather(1, targets[:, None])[:, 0], rtol=1e-12)
    assert torch.equal(c["same"]["kld"], torch.zeros(P, dtype=torch.float64)) and c["same"]["top1"].all()

    s = accuracy.summary(c["got"])
    assert s["positions"] == P and s["kld_mean"] == pytest.approx(float(kld.mean()), rel=1e-9)
    assert s["near_ties"] == int(c["got"]["tie"].sum())
    floor = accuracy.summary(c["same"])
    assert not accuracy.lossless(s, floor) and accuracy.lossless(floor, floor)
