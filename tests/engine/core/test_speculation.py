"""Speculation's scheduling half, model-free: prompt lookup's proposals, drafts within the room, the token budget and
the pool, adaptive k from the cost model, and the simulator's measured-rate drafts and acceptance."""
import random

import pytest

from engine import SamplingParams
from engine.core.request import Request
from engine.core.simulator import CostModel, RateDrafter, SimRunner, VirtualClock
from engine.core.speculation import NgramDrafter, Speculation
from engine.factory import build_engine
from engine.specs import PolicySpec
from pipeline.config import kv_spec


def brute_lookup(seq: list[int], lo: int, hi: int, k: int) -> tuple[int, ...]:
    """The definition: for n = hi down to lo, the latest earlier occurrence of the last n tokens, and what followed."""
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        for end in range(len(seq) - 2, n - 2, -1):
            if seq[end + 1 - n:end + 1] == seq[-n:]:
                return tuple(seq[end + 1:end + 1 + k])
    return ()


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(1, 3)
    req = Request("a", [7, 8, 9, 4, 7, 8, 5, 6, 7, 8], SamplingParams())
    assert d.propose(req, 4) == (5, 6, 7, 8)  # "7 8" last seen before position 5 ends at 5: 5 6 7 8 followed
    req.output.append(9)  # ... 7 8 9: "7 8 9" occurred at the start
    assert d.propose(req, 2) == (4, 7)
    assert NgramDrafter(2, 3).propose(Request("b", [1, 2, 3, 4], SamplingParams()), 3) == ()


def test_prompt_lookup_indexes_as_tokens_arrive_like_a_search_from_scratch():
    rng = random.Random(0)
    for trial in range(30):
        lo = rng.randint(1, 2)
        hi = lo + rng.randint(0, 2)
        d = NgramDrafter(lo, hi)
        req = Request(str(trial), [rng.randrange(4) for _ in range(rng.randint(1, 12))], SamplingParams())
        for _ in range(25):
            seq = req.prompt + req.output
            assert d.propose(req, 3) == brute_lookup(seq, lo, hi, 3), (seq, lo, hi)
            req.output.append(rng.randrange(4))


def engine_over(cost, batch, k, adaptive=False, kv="slot", acceptance=1.0, rate=1.0, budget=None):
    clock = VirtualClock()
    runner = SimRunner(cost, clock, acceptance=acceptance)
    spec = Speculation(RateDrafter(rate, k, seed=1), k, adaptive, cost)
    policy = PolicySpec.of("chunked", batch, token_budget=budget) if budget else PolicySpec.of("continuous", batch)
    pool = kv_spec("paged", block_size=4, num_blocks=batch * 70 + 8) if kv == "paged" else kv_spec("slot")
    return build_engine(None, policy, 256, runner=runner, clock=clock, kv=pool, speculation=spec), spec


def test_drafts_stay_within_the_output_room_and_every_kept_token_counts():
    cost = CostModel(0.01, {"num_decode_rows": 0.001})
    eng, spec = engine_over(cost, 2, 4)
    outs = eng.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_new_tokens=7, ignore_eos=True),
                                              SamplingParams(max_new_tokens=2, ignore_eos=True)])
    assert [len(o) for o in outs] == [7, 2]
    steps = eng.take_records()
    # a: 1 token from its prefill, then 4 drafts all kept and the one sampled, then 1 (no room); b: no room after 1
    assert spec.num_accepted == spec.num_draft_tokens == sum(s.num_draft_tokens for s in steps) == 4
    assert [s.num_decode_rows for s in steps] == [0, 4 + 1 + 1, 1]


def test_chunked_drafts_come_out_of_the_token_budget():
    cost = CostModel(0.01, {"num_decode_rows": 0.001})
    eng, spec = engine_over(cost, 4, 4, budget=6)
    eng.generate([[1] * 5] * 4, SamplingParams(max_new_tokens=12, ignore_eos=True))
    steps = eng.take_records()
    assert all(s.num_tokens <= 6 for s in steps) and spec.num_draft_tokens > 0


def test_a_paged_draft_takes_only_free_blocks_and_gives_back_rejected_ones():
    cost = CostModel(0.01, {"num_decode_rows": 0.001})
    eng, spec = engine_over(cost, 3, 4, kv="paged", acceptance=0.5)
    pool = eng.scheduler.blocks
    taken = []
    while not taken or eng.has_work():
        if not taken:
            eng.add_request("a", [1] * 9, SamplingParams(max_new_tokens=30, ignore_eos=True))
        eng.step()
        taken.append(pool.num_used)
        pool.check()
        for r in eng.scheduler.running:  # after rollback: blocks for its tokens and the next one, no more
            assert len(pool.table(r.rid)) == pool.blocks_for(r.num_tokens)
    assert 0 < spec.num_accepted < spec.num_draft_tokens and pool.num_free == pool.num_blocks


def test_adaptive_k_speculates_when_rows_are_cheap_and_stops_when_they_are_not():
    """A memory-bound step (fixed cost, rows nearly free) takes the largest k; one where each row costs as much as
    the fixed part takes 0 at a large batch."""
    bound = CostModel(0.02, {"num_decode_rows": 0.0001})
    eng, spec = engine_over(bound, 1, 4, adaptive=True, acceptance=0.8)
    eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert spec.chosen_k[0] == 0 and spec.chosen_k[4] >= sum(spec.chosen_k.values()) - 3  # less: the output's end
    busy = CostModel(0.001, {"num_decode_rows": 0.002})
    eng, spec = engine_over(busy, 64, 4, adaptive=True, acceptance=0.8)
    eng.generate([[1, 2, 3]] * 64, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert set(spec.chosen_k) == {0} and spec.num_draft_tokens == 0


def test_adaptive_k_needs_a_cost_model_and_request_level_policies_refuse():
    with pytest.raises(ValueError, match="cost model"):
        Speculation(RateDrafter(1.0, 4), 4, adaptive=True)
    with pytest.raises(ValueError, match="cannot speculate"):
        build_engine(None, PolicySpec.of("static", 2, max_batch=2), 64,
                     runner=SimRunner(CostModel(0.01), VirtualClock()), speculation=Speculation(RateDrafter(1.0, 2), 2))


def test_the_simulator_keeps_drafts_at_the_measured_acceptance():
    cost = CostModel(0.01, {"num_decode_rows": 0.001})
    kept = {}
    for acceptance in (0.0, 0.6, 1.0):
        eng, spec = engine_over(cost, 8, 4, acceptance=acceptance, rate=0.5)
        eng.generate([[1, 2]] * 8, SamplingParams(max_new_tokens=200, ignore_eos=True))
        kept[acceptance] = spec.acceptance
        assert 0.4 < spec.num_drafts / spec.num_asked < 0.6
    assert kept[0.0] == 0.0 and kept[1.0] == 1.0 and abs(kept[0.6] - 0.6) < 0.08


def test_a_request_preempted_after_drafting_and_aborted_while_waiting_leaves_no_state():
    cost = CostModel(0.01, {"num_decode_rows": 0.001})
    eng, spec = engine_over(cost, 2, 4)
    eng.scheduler.speculation.drafter = NgramDrafter(1, 2)
    eng.add_request("a", [0, 5, 0, 5], SamplingParams(max_new_tokens=20, ignore_eos=True))  # the runner says 0
    eng.step()
    eng.step()  # a decode: a's n-grams indexed, its acceptance counted
    assert spec.drafter._index and spec._rates
    req = eng.scheduler.requests["a"]
    eng.scheduler.running.remove(req)  # as a preemption leaves it: back in the queue
    req.status = req.status.WAITING
    eng.scheduler.waiting.appendleft(req)
    assert eng.abort("a").finish_reason == "abort"
    assert not spec.drafter._index and not spec._rates
