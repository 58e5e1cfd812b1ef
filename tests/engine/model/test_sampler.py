"""Batched sampling: seeded requests reproduce whatever else is in the batch; top-k 1 and tiny top-p are greedy;
top-k/top-p and penalties against hand computations; logprobs; every tensor on the logits' device."""
import math

import pytest
import torch

from engine import SamplingParams
from engine.factory import build_engine
from engine.kernels import build
from engine.model.sampler import Sampler, first_argmax, token_logprobs
from engine.specs import PolicySpec
from pipeline.config import policy_spec

OPS = build.ops()  # the native first_argmax where it builds (it runs on fp32 rows)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    s = Sampler(seed=0)
    greedy = logits.argmax(-1).tolist()
    assert s(logits.clone(), list("abcd"), [SamplingParams(temperature=1.0, top_k=1)] * 4) == greedy
    assert s(logits.clone(), list("efgh"), [SamplingParams(temperature=1.0, top_p=1e-6)] * 4) == greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the fused kernel's (fp32 on a CPU), block maxima
def test_first_argmax_is_argmax_with_ties_nans_and_tails(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 4096), (1, 3072), (3, 1000), (2, 1024), (2, 17), (5, 1), (3, 70), (64, 49152)]:
        for x in (torch.randn(shape, generator=g), torch.randint(0, 3, shape, generator=g).float()):
            x = x.to(dtype)
            assert torch.equal(first_argmax(x, OPS), x.argmax(-1)), shape
    x = torch.zeros(2, 4096, dtype=dtype)
    x[:, [5, 1030, 4000]] = 1.0  # the maximum in three blocks: the first one wins
    assert first_argmax(x, OPS).tolist() == [5, 5]
    x = torch.randn(5, 333, generator=g).to(dtype)
    x[0, [7, 300]] = math.nan  # a NaN is the maximum, the first one
    x[1, 332] = math.inf  # in the tail past the last whole vector
    x[2] = -math.inf
    x[3] = -x[3].abs()
    x[3, [5, 9]] = torch.tensor([-0.0, 0.0], dtype=dtype)  # equal maxima of either sign: the first
    x[4, 200:] = x[4].max() + 1  # a run of equal maxima
    assert first_argmax(x, OPS).tolist() == [7, 332, 0, 5, 200]
    for x in (torch.randn(6, 200, generator=g)[:, 3:150], torch.randn(4096, 3, generator=g).t()):  # strided
        x = x.to(dtype)
        assert torch.equal(first_argmax(x, OPS), x.argmax(-1))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 1e-9]]))
    s = Sampler(seed=0)
    picks = [s(logits.clone(), [f"r{i}"], [SamplingParams(temperature=1.0)])[0] for i in range(2000)]
    freq = [picks.count(t) / len(picks) for t in range(4)]
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.04 and freq[3] == 0.0


def test_seeded_request_is_the_same_alone_or_in_a_batch(tiny_llama):
    p = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=20, temperature=1.3, ignore_eos=True)
    alone = build_engine(tiny_llama, PolicySpec.of("continuous", 4), 64).generate([[5, 6, 7]], p)[0]
    crowd = build_engine(tiny_llama, PolicySpec.of("continuous", 4), 64).generate(
        [[9, 9], [5, 6, 7], [4] * 8], [other, p, other])
    assert crowd[1] == alone
    greedy = build_engine(tiny_llama, PolicySpec.of("continuous", 4), 64).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert alone != greedy  # sampling really sampled


def test_top_k_and_top_p_keep_the_hand_computed_tokens():
    """p = [0.4, 0.3, 0.15, 0.1, 0.05]. top_k=2 keeps tokens 0 and 1, renormalised to 4/7 and 3/7. top_p=0.6
    keeps a token while the mass before it is < 0.6: token 0 (0), token 1 (0.4); token 2 (0.7) is out: again
    4/7 and 3/7. top_p=0.8 keeps 0, 1, 2 (mass before 2 = 0.7): 0.4/0.85, 0.3/0.85, 0.15/0.85."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    s = Sampler(seed=0)
    n = 3000
    for params, want in [(SamplingParams(temperature=1.0, top_k=2), [4 / 7, 3 / 7, 0, 0, 0]),
                         (SamplingParams(temperature=1.0, top_p=0.6), [4 / 7, 3 / 7, 0, 0, 0]),
                         (SamplingParams(temperature=1.0, top_p=0.8), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])]:
        picks = [s(logits.clone(), [f"{params}-{i}"], [params])[0] for i in range(n)]
        freq = [picks.count(t) / n for t in range(5)]
        for f, w in zip(freq, want):
            assert (f == 0.0) if w == 0 else abs(f - w) < 0.035, (params, freq, want)


def test_penalties_follow_hf_and_openai():
    """repetition 2: a seen positive logit halves, a seen negative one doubles; frequency 0.5 and presence 1.0
    subtract 0.5 per output occurrence and 1.0 once (output tokens only)."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    p = SamplingParams(repetition_penalty=2.0)
    out = Sampler._penalize(logits, [p], [([0, 1], [])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5, 3.0]]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = Sampler._penalize(logits, [p], [([4], [2, 2, 3])])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 1.0, 0.5 - 0.5 - 1.0, 3.0]]
    # greedy would pick token 4 (logit 3); a repetition penalty of 2 on it (seen in the prompt) makes it 1.5 < 2.0
    s = Sampler(seed=0)
    assert s(logits.clone(), ["g"], [SamplingParams()], {}) == [4]
    assert s(logits.clone(), ["g"], [SamplingParams(repetition_penalty=2.0)], {"g": ([4], [])}) == [0]


def test_logprobs_are_the_raw_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    got = token_logprobs(logits.log_softmax(-1), [1, 2], [2, 0])
    assert abs(got[0][0] - math.log(0.3)) < 1e-6 and [t for t, _ in got[0][1]] == [0, 1]
    assert abs(got[0][1][0][1] - math.log(0.5)) < 1e-6 and got[1][1] == () and abs(got[1][0] - math.log(0.8)) < 1e-6


def test_ignore_eos_rows_never_pick_an_end_id_and_other_rows_may():
    """Every row ignoring eos, or some: the end ids (the largest logits here) are out for exactly those rows."""
    sampler = Sampler(seed=0, eos_ids=[2, 7])
    logits = torch.zeros(3, 10)
    logits[:, 2], logits[:, 7], logits[:, 4] = 9.0, 8.0, 1.0
    keep, drop = SamplingParams(), SamplingParams(ignore_eos=True)
    assert sampler(logits.clone(), ["a", "b", "c"], [drop, drop, drop]) == [4, 4, 4]
    assert sampler(logits.clone(), ["a", "b", "c"], [keep, drop, keep]) == [2, 4, 2]


def test_every_tensor_lives_on_the_logits_device():
    """On the meta device a CPU tensor made by mistake fails with a device mismatch; a device-clean path runs to
    its first read-back of values, which meta cannot give."""
    logits = torch.empty(3, 50, device="meta")
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3,
                                              frequency_penalty=0.2, ignore_eos=True), SamplingParams(temperature=1.0)]
    with pytest.raises(NotImplementedError, match="meta"):
        Sampler(seed=0, eos_ids=[2])(logits, ["a", "b", "c"], params, {"b": ([1, 2], [3])})


@pytest.mark.parametrize("policy", [policy_spec("static", max_batch=3), policy_spec("dynamic", max_batch=3),
                                    policy_spec("bucketed", max_batch=3)])
def test_penalised_requests_in_a_held_batch_finish_as_they_would_alone(tiny_llama, policy):
    """A batch that holds its finished rows (zombies) beside penalised ones: every request's tokens are its own, as
    run one at a time."""
    prompts = [[5, 6, 7, 5], [9, 9, 8], [3, 4]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2) for n in (2, 7, 4)]
    held = build_engine(tiny_llama, policy, 32, eos_ids=[2])
    alone = build_engine(tiny_llama, PolicySpec.of("continuous", 1), 32, eos_ids=[2])
    assert held.generate(prompts, params) == [alone.generate([p], [sp])[0] for p, sp in zip(prompts, params)]


def test_a_finished_requests_generator_is_released(tiny_llama):
    """Sampled requests' generators go with the requests: once the next batch has run, the first one's are gone,
    zombies of a held batch included (they sample greedily)."""
    for policy in (PolicySpec.of("continuous", 4), policy_spec("dynamic", max_batch=3, max_wait_ms=0)):
        engine = build_engine(tiny_llama, policy, 32, eos_ids=[2])
        hot = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0, seed=n) for n in (2, 5, 3)]
        engine.generate([[5, 6], [7], [8, 9, 10]], hot)
        engine.step()  # idle: nothing runs, nothing is lost
        engine.generate([[4]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert engine.runner.sampler._rngs == {}, policy
