"""Speculative decoding with a model: drafts verified in the shared step give Hugging Face generate's tokens for every
iteration-level policy on the slot and the paged cache (prefix caching, a pool small enough to preempt, aborts with
drafts in flight, a random draft model), no block is left held, and the sampled path draws from the target's
distribution (a seeded chi-square test)."""
import pytest
import torch
from scipy.stats import chi2

from engine import SamplingParams
from engine.core.speculation import NgramDrafter, Speculation
from engine.factory import build_engine, load_source
from engine.model.draft import DraftModel
from engine.model.hf import generate_alone
from engine.model.loader import eos_ids
from engine.specs import PolicySpec
from pipeline.config import kv_spec
from pipeline.measuring.equivalence import ARRIVE, LENS, scenario_prompts
from tests.conftest import model_cfg
from tests.engine.model.test_paged import BS, PAGED_ARRIVE, PAGED_LENS, paged_prompts, run_paged

POLICIES = [PolicySpec.of("continuous", 3), PolicySpec.of("mixed", 3), PolicySpec.of("chunked", 3, token_budget=16)]
KVS = {"slot": kv_spec("slot"), "paged": kv_spec("paged", block_size=BS, num_blocks=60)}


def lookup(k: int = 4) -> Speculation:
    """Prompt lookup from a single token on: random models' outputs repeat often, so most steps draft."""
    return Speculation(NgramDrafter(1, 3), k)


@pytest.fixture(scope="module")
def scenario(tiny):
    name, model = tiny
    prompts = scenario_prompts(model, None)
    return name, model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


@pytest.mark.parametrize("kv", list(KVS))
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_seed_scenario_with_speculation_matches_generate(scenario, policy, kv):
    name, model, prompts, ref = scenario
    spec = lookup()
    eng, out, streamed = run_paged(model, policy, KVS[kv], prompts, LENS, ARRIVE, speculation=spec)
    assert [out[str(i)] for i in range(6)] == ref, f"{name} {policy.name} {kv}"
    assert [streamed[str(i)] for i in range(6)] == ref
    assert spec.num_accepted > 0 and spec.num_accepted < spec.num_draft_tokens, "drafts both kept and rejected"
    assert sum(spec.accepted_per_pos) == spec.num_accepted
    assert sum(s.num_draft_tokens for s in eng.records) == spec.num_draft_tokens
    if kv == "paged":
        assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks, "a block is still held"


@pytest.mark.parametrize("pool, prefix_caching", [(22, True), (200, False)], ids=["tight-cached", "roomy"])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_paged_stress_with_speculation_matches_generate(tiny, policy, pool, prefix_caching):
    """test_paged's prompts (shared prefixes, lengths at block edges), a pool that preempts (tight) or not; the pool's
    invariants hold after every step (run_paged)."""
    name, model = tiny
    prompts = paged_prompts(model)
    kv = kv_spec("paged", block_size=BS, num_blocks=pool, prefix_caching=prefix_caching)
    spec = lookup()
    eng, out, _ = run_paged(model, PolicySpec.of(policy.name, 4, **policy.knobs), kv, prompts, PAGED_LENS,
                            PAGED_ARRIVE, speculation=spec)
    for i, (p, n) in enumerate(zip(prompts, PAGED_LENS)):
        assert out[str(i)] == generate_alone(model, p, n), f"{name} {policy.name}: request {i}"
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks and spec.num_draft_tokens > spec.num_accepted > 0
    assert (blocks.hit_tokens > 0) == prefix_caching
    if pool == 22:
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kv", list(KVS))
def test_aborts_with_drafts_in_flight_lose_nothing(tiny_llama, kv):
    """Requests aborted right after steps that drafted for them: the others still give generate's tokens, the
    aborted ones end with an abort event and hold nothing."""
    prompts = scenario_prompts(tiny_llama, None)
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 6), 256, eos_ids=eos_ids(tiny_llama), kv=KVS[kv],
                       speculation=lookup())
    reqs = [eng.add_request(str(i), p, SamplingParams(max_new_tokens=40, ignore_eos=True))
            for i, p in enumerate(prompts)]
    plans, run = [], eng.runner.run
    eng.runner.run = lambda plan: plans.append(plan) or run(plan)
    aborted = set()
    while eng.has_work():
        eng.step()
        drafted = [c.rid for c in plans[-1].chunks if c.draft and eng.scheduler.requests.get(c.rid)]
        if drafted and len(aborted) < 2:
            assert eng.abort(drafted[0]).finish_reason == "abort"
            aborted.add(drafted[0])
    assert len(aborted) == 2
    for r, p in zip(reqs, prompts):
        if r.rid in aborted:
            assert r.finish_reason == "abort"
        else:
            assert r.output == generate_alone(tiny_llama, p, 40)
    if kv == "paged":
        assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks
    assert not eng.scheduler.speculation._rates and not eng.scheduler.speculation.drafter._index


def test_a_random_draft_model_lowers_acceptance_never_correctness(scenario):
    """A draft of the same architecture with other random weights: its proposals are mostly wrong, the tokens right."""
    name, model, prompts, ref = scenario
    draft = load_source(model_cfg(name, seed=7))[0]
    spec = Speculation(DraftModel(draft, model.config.vocab_size), 3)
    _, out, _ = run_paged(model, POLICIES[2], KVS["paged"], prompts, LENS, ARRIVE, speculation=spec)
    assert [out[str(i)] for i in range(6)] == ref, name
    assert spec.num_drafts > 0 and spec.num_accepted < 0.5 * spec.num_draft_tokens


def test_a_draft_model_needs_the_targets_vocabulary(tiny_llama):
    other = load_source(model_cfg("tiny-llama", config={**model_cfg("tiny-llama").config, "vocab_size": 300}))[0]
    with pytest.raises(ValueError, match="target's vocabulary \\(512 ids\\)"):
        DraftModel(other, 512)


def test_logprobs_of_kept_drafts_are_the_models(tiny_llama):
    """Every token's logprob and top alternatives, drafted or not, equal the engine's without speculation."""
    prompts = scenario_prompts(tiny_llama, None)[:3]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=2)
    events = {}
    for spec in (None, lookup()):
        eng = build_engine(tiny_llama, PolicySpec.of("continuous", 3), 256, speculation=spec)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        got = []
        while eng.has_work():
            got += [(e.rid, e.token, e.logprob, e.top_logprobs) for e in eng.step()]
        events[spec is None] = sorted(got, key=lambda e: int(e[0]))  # each request's events stay in order
        assert spec is None or spec.num_accepted > 0
    for (rid, tok, lp, top), (rid2, tok2, lp2, top2) in zip(events[True], events[False], strict=True):
        assert (rid, tok, [t for t, _ in top]) == (rid2, tok2, [t for t, _ in top2])
        assert lp2 == pytest.approx(lp, abs=1e-4)
        assert [v for _, v in top2] == pytest.approx([v for _, v in top], abs=1e-4)


class Fixed:
    """A drafter that always proposes the same token."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, req, k):
        return (self.token,)

    def forget(self, rid):
        pass


FALSE_ALARM = 1e-3  # the chance this test fails on a correct sampler


def test_sampled_rows_with_drafts_draw_from_the_target(tiny_llama):
    """2,000 seeded requests of three tokens at temperature 1, top-k 4: the second token is verified against a fixed
    draft (kept with probability p(d), else drawn from p without d). Grouped by the first token, its counts fit the
    target's top-4 distribution (chi-square, false-alarm rate 1e-3); a sampler that kept every draft would not."""
    model = tiny_llama
    prompt = [5, 17, 33, 2 + 7, 101]
    with torch.inference_mode():
        first = model(torch.tensor([prompt])).logits[0, -1].float()
        t1 = int(first.argmax())
        second = model(torch.tensor([prompt + [t1]])).logits[0, -1].float()
    draft = int(second.argmax())  # likely after the commonest first token: kept often, rejected often too
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, seed=s) for s in range(2000)]
    spec = Speculation(Fixed(draft), 1)
    eng = build_engine(model, PolicySpec.of("continuous", 250), 64, speculation=spec)
    outs = eng.generate([prompt] * len(params), params)
    assert spec.num_drafts == len(params) and 0 < spec.num_accepted < spec.num_drafts
    groups = {}
    for a, b, _ in outs:
        groups.setdefault(a, []).append(b)
    stat, dof, kept_all = 0.0, 0, 0.0
    with torch.inference_mode():
        for a, seconds in groups.items():
            logits = model(torch.tensor([prompt + [a]])).logits[0, -1].float()
            top = logits.topk(4)
            p = dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))
            assert set(seconds) <= set(p), "a token outside the top 4"
            n = len(seconds)
            stat += sum((seconds.count(t) - n * q) ** 2 / (n * q) for t, q in p.items())
            dof += len(p) - 1
            q = p.get(draft, 0.0)  # a sampler keeping every draft: all n at d
            kept_all += n * (1 - q) ** 2 / q + n * (1 - q) if q else float("inf")
    assert chi2.sf(stat, dof) > FALSE_ALARM, f"chi-square {stat:.1f} on {dof} degrees of freedom"
    assert chi2.sf(kept_all, dof) < FALSE_ALARM, "the test could not tell a sampler that keeps every draft"
