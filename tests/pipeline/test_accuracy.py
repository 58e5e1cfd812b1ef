"""check_precision's figures (pipeline.measuring.accuracy) against the definitions computed directly in fp64: KL
divergence, top-1 agreement, near-ties and the stream's negative log-likelihoods, over more positions than one
block of rows; identical logits give a divergence of exactly zero; lossless is decided against the floor; a greedy
output cut short is no exact match; the stream's prompts are distinct, and a committed stream is read only where it
holds the sequences, length and seed asked, and stops the run, named, where it is damaged."""
import json

import pytest
import torch

from engine.factory import build_net
from pipeline.config import compose_config
from pipeline.measuring import accuracy

RULE = compose_config([]).bench.precision  # near_tie, lossless_kld, lossless_top1


def test_compare_matches_the_definitions_across_row_blocks():
    g = torch.Generator().manual_seed(0)
    P, V = accuracy.ROWS + 37, 300
    ref = torch.randn(P, V, generator=g) * 4
    ref[3, :2] = ref[3].max() + torch.tensor([1.0, 1.0 - 1e-4])  # a near-tie of the reference's top two
    got = ref + torch.randn(P, V, generator=g) * 0.05
    targets = torch.randint(0, V, (P,), generator=g)
    c = accuracy.compare(ref, {"got": got, "same": ref.clone()}, targets, RULE.near_tie)

    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    assert torch.allclose(c["got"]["kld"], kld, rtol=1e-9, atol=1e-15)
    assert torch.equal(c["got"]["top1"], ref.argmax(-1) == got.argmax(-1))
    assert not c["got"]["top1"].all()  # the noise flips some positions: the check can fail
    top2 = ref.double().topk(2, dim=-1).values
    assert torch.equal(c["got"]["tie"], top2[:, 0] - top2[:, 1] < RULE.near_tie) and c["got"]["tie"][3]
    assert torch.allclose(c["got"]["nll_ref"], -lp.gather(1, targets[:, None])[:, 0], rtol=1e-12)
    assert torch.allclose(c["got"]["nll_got"], -lq.gather(1, targets[:, None])[:, 0], rtol=1e-12)
    assert torch.equal(c["same"]["kld"], torch.zeros(P, dtype=torch.float64)) and c["same"]["top1"].all()

    s = accuracy.summary(c["got"])
    assert s["positions"] == P and s["kld_mean"] == pytest.approx(float(kld.mean()), rel=1e-9)
    assert s["near_ties"] == int(c["got"]["tie"].sum())
    floor = accuracy.summary(c["same"])
    assert not accuracy.lossless(s, floor, RULE) and accuracy.lossless(floor, floor, RULE)


def test_an_output_cut_short_or_run_long_is_no_exact_match():
    ref = [[5, 6, 7, 8], [1, 2, 3], [4, 4], [9, 9, 9]]
    got = [[5, 6, 7], [1, 2, 3], [4, 3], [9, 9, 9, 9]]  # truncated, equal, diverging, one token too many
    assert accuracy.greedy_agreement(ref, got) == {"greedy_exact": 0.25, "first_divergences": [1, 3, 3]}


def test_stream_prompts_are_distinct_with_and_without_a_tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    for tokenizer in (tok, None):
        prompts = accuracy.stream_prompts(130, 256, tokenizer, 512, 0)  # past twice the chat questions
        assert len({tuple(p) for p in prompts}) == 130
        assert all(len(p) == 128 for p in prompts[3::4])  # every fourth a document of length / 2


def test_a_committed_stream_is_read_where_it_fits_else_one_is_made_here(tiny_llama, tmp_path, monkeypatch):

    net = build_net(tiny_llama)
    made = accuracy.token_stream(net, None, tiny_llama.config.vocab_size, 3, 64, 0)
    monkeypatch.setattr(accuracy, "ROOT", tmp_path)
    monkeypatch.setattr(accuracy, "STREAMS", tmp_path / "data" / "streams")
    seqs, source = accuracy.stream_for("tiny", net, None, tiny_llama.config.vocab_size, 3, 64, 0)
    assert seqs == made and source == "continued by fp32 on this machine"  # none committed
    accuracy.STREAMS.mkdir(parents=True)
    held = [[7] * 64, [8] * 64, [9] * 64, [10] * 64]
    (accuracy.STREAMS / "tiny.json").write_text(json.dumps({"model": "tiny", "seed": 0, "tokens": 64,
                                                            "machine": "M", "sequences": held}))
    seqs, source = accuracy.stream_for("tiny", net, None, tiny_llama.config.vocab_size, 3, 64, 0)
    assert seqs == held[:3] and source == "data/streams/tiny.json (continued by fp32 on M)"
    for other in ((5, 64, 0), (3, 48, 0), (3, 64, 1)):  # more sequences than held, another length, another seed
        assert accuracy.stream_for("tiny", net, None, tiny_llama.config.vocab_size, *other)[1] == \
            "continued by fp32 on this machine"


@pytest.mark.parametrize("damage", ["cut", "length", "vocab"])
def test_a_damaged_committed_stream_stops_naming_the_file_and_the_mend(tiny_llama, tmp_path, monkeypatch, damage):
    monkeypatch.setattr(accuracy, "ROOT", tmp_path)
    monkeypatch.setattr(accuracy, "STREAMS", tmp_path / "data" / "streams")
    accuracy.STREAMS.mkdir(parents=True)
    vocab = tiny_llama.config.vocab_size
    held = {"model": "tiny", "seed": 0, "tokens": 64, "machine": "M", "sequences": [[7] * 64, [8] * 64]}
    text = json.dumps(held)
    if damage == "cut":
        text = text[:len(text) // 2]
    elif damage == "length":
        text = json.dumps({**held, "sequences": [[7] * 64, [8] * 63]})
    else:
        text = json.dumps({**held, "sequences": [[7] * 64, [vocab] * 64]})
    (accuracy.STREAMS / "tiny.json").write_text(text)
    with pytest.raises(ValueError, match=r"streams/tiny\.json is damaged .*git checkout -- data/streams/tiny\.json"):
        accuracy.stream_for("tiny", None, None, vocab, 2, 64, 0)
