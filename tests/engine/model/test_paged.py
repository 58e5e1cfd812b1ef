"""The paged KV cache with a model: attention through shuffled, shared block tables equals dense SDPA, and every
iteration-level policy on paged KV gives Hugging Face generate's tokens, with and without prefix caching and on a
pool small enough to preempt."""
import random

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.factory import build_engine, build_net
from engine.model.hf import generate_alone
from engine.model.kv_cache import PagedCache
from engine.model.loader import eos_ids
from engine.model.runner import ModelRunner
from engine.specs import PolicySpec
from pipeline.config import kv_spec
from pipeline.measuring.equivalence import ARRIVE, LENS, scenario_prompts

BS = 4  # tokens per block in these tests: short prompts cross many block boundaries


def attend_through_tables(model, specs, num_blocks=64, seed=0):
    """One attention step of layer 0 on a paged cache. specs: (cached prefix length, new tokens, index of an earlier
    sequence whose prefix blocks this one shares, or None). Tables take blocks in shuffled order; each prefix's K/V
    is written through its table first. Returns (attention output, per-sequence reference from dense SDPA)."""
    net = build_net(model)
    cache = PagedCache(net.num_layers, num_blocks, BS, net.num_kv_heads, net.head_dim)
    runner = ModelRunner(net, cache)
    KV, D = net.num_kv_heads, net.head_dim
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    chunks, truth = [], []
    for i, (start, n, share) in enumerate(specs):
        shared = list(chunks[share].blocks[:start // BS]) if share is not None else []
        table = shared + [free.pop() for _ in range(-(-(start + n) // BS) - len(shared))]
        k, v = torch.randn(start + n, KV, D, generator=g), torch.randn(start + n, KV, D, generator=g)
        if shared:  # the same blocks hold the same K/V
            m = len(shared) * BS
            k[:m], v[:m] = truth[share][0][:m], truth[share][1][:m]
        truth.append((k, v))
        pos = torch.arange(start)
        cache.write(0, cache.rows(torch.tensor(table, dtype=torch.long)[pos // BS], pos), k[:start], v[:start])
        chunks.append(ScheduledChunk(str(i), start, (5,) * n, sample=True, prompt=n > 1, blocks=tuple(table)))
    assert any(list(c.blocks) != list(range(c.blocks[0], c.blocks[0] + len(c.blocks))) for c in chunks)
    inputs = runner.inputs(SchedulerOutput(tuple(chunks)))
    q = torch.randn(len(inputs.positions), net.num_heads, D, generator=g)
    k_new = torch.cat([k[s:] for (k, _), (s, _, _) in zip(truth, specs)])
    v_new = torch.cat([v[s:] for (_, v), (s, _, _) in zip(truth, specs)])
    cache.write(0, cache.rows(inputs.places, inputs.positions), k_new, v_new)
    out = inputs.attention.attend(net, 0, q, k_new, v_new, cache)
    refs, t0 = [], 0
    for (k, v), (s, n, _) in zip(truth, specs):
        seen = torch.arange(s + n)[None, :] <= s + torch.arange(n)[:, None]  # causal, aligned to the keys' end
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q[t0:t0 + n], k, v)), attn_mask=seen,
                                           scale=net.attn_scale, enable_gqa=True)
        refs.append(o[0].transpose(0, 1))
        t0 += n
    return out, torch.cat(refs)


STEPS = {  # (cached prefix, new tokens, shares the prefix blocks of)
    "mixed": [(0, 1, None), (0, BS, None), (0, BS + 1, None), (0, 3 * BS, None), (2 * BS, 5, None),
              (2 * BS, 1, 4), (2 * BS, BS, 4), (11, 1, None), (BS, BS + 1, None)],
    "prompt chunks": [(0, BS, None), (0, BS + 1, None), (2 * BS, 3 * BS, None), (2 * BS, 2, 2), (3, 9, None)],
    "equal whole prompts": [(0, 2 * BS, None), (0, 2 * BS, None)],
    "decodes": [(0, 1, None), (3, 1, None), (BS, 1, None), (4 * BS, 1, None), (4 * BS, 1, 3), (7, 1, None)],
}


@pytest.mark.parametrize("kind", list(STEPS))
def test_attention_through_block_tables_equals_dense_sdpa(tiny, kind):
    name, model = tiny
    out, ref = attend_through_tables(model, STEPS[kind])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"{name} {kind}")


def test_paged_pool_size_is_the_budget(tiny_llama):
    """1 MiB of tiny-llama K/V (512 bytes per token) in blocks of 16: 128 blocks, allocated once."""
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 4), 96,
                    kv=kv_spec("paged", memory_mb=1, block_size=16))
    assert eng.scheduler.blocks.num_blocks == 128 and eng.runner.cache.nbytes == 2**20
    ptrs = [t.data_ptr() for t in eng.runner.cache.k]
    eng.generate([[5] * 10, [6] * 30], SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert [t.data_ptr() for t in eng.runner.cache.k] == ptrs and eng.scheduler.blocks.num_free == 128


def paged_prompts(model) -> list[list[int]]:
    """Lengths 1, BS, BS + 1 and k x BS, prompts sharing a prefix, and whole prompts asked again."""
    rng = random.Random(0)
    base = [rng.randrange(3, model.config.vocab_size) for _ in range(40)]
    tail = [rng.randrange(3, model.config.vocab_size) for _ in range(12)]
    return [base, [base[0]], base[:BS], base[1:BS + 2], tail, base[:20] + tail[:10], list(base), list(tail),
            base[:BS + 1]]


PAGED_LENS = [25, 8, 12, 20, 30, 14, 6, 18, 9]
PAGED_ARRIVE = {0: [0, 1, 2], 2: [3, 4], 6: [5, 6], 9: [7, 8]}
POLICIES = [PolicySpec.of("naive", 1), PolicySpec.of("continuous", 4),
            PolicySpec.of("mixed", 4), PolicySpec.of("chunked", 4, token_budget=7)]
POOLS = {"roomy": 200, "tight": 22}  # tight: the longest request (65 tokens) fits alone, three do not


def run_paged(model, policy, kv, prompts, lens, arrive, max_request_tokens=256, speculation=None):
    """Arrivals at given steps (1 s each on a virtual clock), a paged pool's invariants checked after every step;
    returns (engine, rid -> output, rid -> the tokens its events carried)."""
    clock = [0.0]
    eng = build_engine(model, policy, max_request_tokens, eos_ids=eos_ids(model), clock=lambda: clock[0], kv=kv,
                       speculation=speculation)
    reqs, streamed, step = {}, {}, 0
    while step <= max(arrive) or eng.has_work():
        for i in arrive.get(step, []):
            reqs[str(i)] = eng.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=lens[i], ignore_eos=True))
            streamed[str(i)] = []
        for e in eng.step():
            streamed[e.rid].append(e.token)
        if eng.scheduler.blocks is not None:
            eng.scheduler.blocks.check()
        clock[0] += 1.0
        step += 1
        assert step < 2000, "did not finish"
    return eng, {rid: r.output for rid, r in reqs.items()}, streamed


@pytest.fixture(scope="module")
def paged_references(tiny):
    name, model = tiny
    prompts = paged_prompts(model)
    return name, model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, PAGED_LENS)]


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_paged_policies_match_generate(paged_references, policy, prefix_caching, pool):
    name, model, prompts, ref = paged_references
    kv = kv_spec("paged", block_size=BS, num_blocks=POOLS[pool], prefix_caching=prefix_caching)
    eng, out, streamed = run_paged(model, policy, kv, prompts, PAGED_LENS, PAGED_ARRIVE)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{name} {policy.name}: request {i} differs"
        assert streamed[str(i)] == expected, f"{name} {policy.name}: request {i}'s stream differs"
    steps, blocks = eng.records, eng.scheduler.blocks
    cached = sum(s.cached_tokens for s in steps)
    assert (cached > 0) == prefix_caching and blocks.hit_tokens == cached and blocks.num_free == blocks.num_blocks
    if pool == "tight" and policy.name != "naive":  # naive runs one request: it always fits
        assert eng.scheduler.num_preemptions > 0 and sum(s.preempted for s in steps) > 0
    if pool == "roomy":  # each prompt prefilled once: the prompt tokens computed drop by the hits
        assert eng.scheduler.num_preemptions == 0
        assert sum(s.num_prompt_tokens for s in steps) == sum(map(len, prompts)) - cached


def test_paged_seed_scenario_matches_generate(tiny):
    """Seed 000's six prompts, staggered, in blocks of the default 16 tokens on the slot cache's memory."""
    name, model = tiny
    prompts = scenario_prompts(model, None)
    _, out, _ = run_paged(model, PolicySpec.of("chunked", 3, token_budget=16), kv_spec("paged"), prompts, LENS,
                          ARRIVE)
    assert [out[str(i)] for i in range(6)] == [generate_alone(model, p, n) for p, n in zip(prompts, LENS)], name


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("policy", POLICIES[1:], ids=[p.name for p in POLICIES[1:]])
def test_real_model_paged_with_preemption(smollm2, policy, prefix_caching):
    """SmolLM2-135M on its six chat prompts (three of them asked twice) in a pool of 8 blocks of 16 tokens:
    preemptions, prefix hits, and generate's tokens."""
    model, tok = smollm2
    prompts = scenario_prompts(model, tok)
    prompts, lens = prompts + prompts[:3], LENS + [8, 8, 8]
    arrive = {**ARRIVE, 24: [6, 7, 8]}
    key = "_smollm2_paged_ref"
    if not hasattr(test_real_model_paged_with_preemption, key):
        setattr(test_real_model_paged_with_preemption, key,
                [generate_alone(model, p, n) for p, n in zip(prompts, lens)])
    ref = getattr(test_real_model_paged_with_preemption, key)
    kv = kv_spec("paged", num_blocks=8, prefix_caching=prefix_caching)
    eng, out, streamed = run_paged(model, policy, kv, prompts, lens, arrive)
    for i in range(len(prompts)):
        assert out[str(i)] == streamed[str(i)] == ref[i], (i, tok.decode(ref[i]), tok.decode(out[str(i)]))
    assert eng.scheduler.num_preemptions > 0
    assert (eng.scheduler.blocks.hit_tokens > 0) == prefix_caching
