"""Batched sampling: seeded requests reproduce whatever else is in the batch; top-k 1 and tiny top-p are greedy."""
import torch

from engine import LLMEngine, SamplingParams
from engine.sampler import Sampler, first_argmax


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    s = Sampler(seed=0)
    greedy = logits.argmax(-1).tolist()
    assert s(logits.clone(), list("abcd"), [SamplingParams(temperature=1.0, top_k=1)] * 4) == greedy
    assert s(logits.clone(), list("efgh"), [SamplingParams(temperature=1.0, top_p=1e-6)] * 4) == greedy


def test_first_argmax_is_argmax_with_ties():
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 4096), (1, 3072), (3, 1000), (2, 1024)]:
        for x in (torch.randn(shape, generator=g), torch.randint(0, 3, shape, generator=g).float()):
            assert torch.equal(first_argmax(x), x.argmax(-1)), shape
    x = torch.zeros(2, 4096)
    x[:, [5, 1030, 4000]] = 1.0  # the maximum in three blocks: the first one wins
    assert first_argmax(x).tolist() == [5, 5]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 1e-9]]))
    s = Sampler(seed=0)
    picks = [s(logits.clone(), [f"r{i}"], [SamplingParams(temperature=1.0)])[0] for i in range(2000)]
    freq = [picks.count(t) / len(picks) for t in range(4)]
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.04 and freq[3] == 0.0


def test_seeded_request_is_the_same_alone_or_in_a_batch(tiny_llama):
    p = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=20, temperature=1.3, ignore_eos=True)
    alone = LLMEngine(tiny_llama, {"name": "continuous", "max_seats": 4}, 64).generate([[5, 6, 7]], p)[0]
    crowd = LLMEngine(tiny_llama, {"name": "continuous", "max_seats": 4}, 64).generate(
        [[9, 9], [5, 6, 7], [4] * 8], [other, p, other])
    assert crowd[1] == alone
    greedy = LLMEngine(tiny_llama, {"name": "continuous", "max_seats": 4}, 64).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert alone != greedy  # sampling really sampled
