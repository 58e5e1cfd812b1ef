"""Paged KV bookkeeping without a model: the block manager's invariants under a seeded fuzz, prefix-cache reuse that
stays correct under forced hash collisions, and the scheduler's admission, preemption and watermark on blocks."""
import random

import pytest

from engine import RequestError, SamplingParams
from engine.core import kv_blocks
from engine.core.kv_blocks import BlockManager
from engine.core.outputs import RunnerOutput
from engine.core.policies import make_scheduler
from engine.core.request import Request, Status
from engine.core.simulator import CostModel, SimRunner, VirtualClock
from engine.factory import build_engine
from engine.specs import PolicySpec
from pipeline.config import kv_spec, policy_spec


def span(seq):
    return lambda a, b: seq[a:b]


class Fuzz:
    """Random admit / compute / decode / finish / preempt on a small pool. Each block's simulated K/V is, per offset,
    the whole sequence up to that position (what a real K/V depends on), so a reused block is checked for holding
    exactly what the new sequence would have computed there."""

    def __init__(self, bm: BlockManager, rng: random.Random):
        self.bm, self.rng = bm, rng
        self.kv: dict[int, dict[int, tuple]] = {}  # block -> offset -> the sequence up to that position
        self.live: dict[str, list] = {}            # rid -> [sequence, num_computed], admission order
        self.waiting: list[tuple[str, list]] = []  # preempted: (rid, sequence)
        self.seqs: list[list[int]] = [[]]          # earlier sequences: new ones often start with one's prefix
        self.hits = self.preemptions = self.n = 0

    def admit(self, rid, seq) -> bool:
        bm, bs = self.bm, self.bm.block_size
        if not bm.can_allocate(len(seq), span(seq)):
            return False
        hit = bm.allocate(rid, len(seq), span(seq))
        assert hit % bs == 0 and hit <= len(seq) - 1
        for i, b in enumerate(bm.table(rid)[:hit // bs]):
            assert all(self.kv[b][o] == tuple(seq[:i * bs + o + 1]) for o in range(bs)), "a wrong reuse"
        self.hits += hit
        self.live[rid] = [seq, hit]
        return True

    def new_sequence(self):
        base = self.rng.choice(self.seqs)
        seq = base[:self.rng.randint(0, len(base))] + [self.rng.randint(1, 3) for _ in range(self.rng.randint(1, 9))]
        self.seqs.append(seq)
        self.n += 1
        return f"r{self.n}", seq

    def compute(self, rid):
        """A chunk (or the rest of the sequence), written block by block; then a decode token when it is done."""
        bm, bs = self.bm, self.bm.block_size
        seq, done = self.live[rid]
        end = min(len(seq), done + self.rng.randint(1, 6))
        table = bm.table(rid)
        for pos in range(done, end):
            window = range(max(0, pos + 1 - (bm.window or 0)), pos + 1)
            assert not bm.window or all(table[k // bs] != kv_blocks.NULL_BLOCK for k in window), "a key released"
            b = table[pos // bs]
            assert bm.ref[b] == 1, "a write into a shared block"
            self.kv.setdefault(b, {})[pos % bs] = tuple(seq[:pos + 1])
        self.live[rid][1] = end
        bm.cache(rid, end, span(seq))
        bm.slide(rid, end)
        if end == len(seq) and len(seq) >= 30:  # done
            bm.free(rid)
            del self.live[rid]
        elif end == len(seq):  # sampled a token: it needs a slot
            seq.append(self.rng.randint(1, 3))
            while rid in self.live and not bm.grow(rid, len(seq)):
                self.preempt(list(self.live)[-1])
            if bm.window and rid in self.live:  # decoding: the window's blocks and the next token's, no more
                assert sum(b != kv_blocks.NULL_BLOCK for b in table) <= -(-bm.window // bs) + 1

    def preempt(self, rid):
        self.bm.free(rid)
        self.waiting.insert(0, (rid, self.live.pop(rid)[0]))
        self.preemptions += 1

    def step(self):
        r = self.rng.random()
        if self.waiting and r < 0.3:
            rid, seq = self.waiting[0]
            if self.admit(rid, seq):
                self.waiting.pop(0)
        elif r < 0.3 and len(self.live) < 6:
            self.admit(*self.new_sequence())
        elif r < 0.8 and self.live:
            self.compute(self.rng.choice(list(self.live)))
        elif r < 0.92 and self.live:
            rid = self.rng.choice(list(self.live))
            self.bm.free(rid)
            del self.live[rid]
        elif self.live:
            self.preempt(list(self.live)[-1])

    def drain(self):
        for rid in list(self.live):
            self.bm.free(rid)
        self.live.clear()
        self.bm.check()
        assert self.bm.num_free == self.bm.num_blocks - self.bm.reserved and sum(self.bm.ref) == 0


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_keeps_the_invariants_and_reuses_only_equal_prefixes(seed, prefix_caching, window):
    """With a window of 6 positions (blocks of 4), a sequence keeps at most 3 blocks past its prefill: every key of
    its window still held, the rest released."""
    fz = Fuzz(BlockManager(num_blocks=20, block_size=4, watermark=1, prefix_caching=prefix_caching, window=window),
              random.Random(seed))
    for _ in range(3000):
        fz.step()
        fz.bm.check()
    fz.drain()
    assert fz.preemptions > 0
    assert (fz.hits > 0) == prefix_caching and fz.bm.hit_tokens == fz.hits


@pytest.mark.parametrize("seed", range(2))
def test_a_constant_hash_cannot_cause_a_wrong_reuse(monkeypatch, seed):
    """Every block gets the same key: lookups meet blocks of other tokens and other parents, and refuse them."""
    monkeypatch.setattr(kv_blocks, "chain_hash", lambda parent, tokens: 0)
    fz = Fuzz(BlockManager(num_blocks=20, block_size=4, watermark=1), random.Random(seed))
    for _ in range(3000):
        fz.step()
        fz.bm.check()
    fz.drain()
    assert fz.hits > 0  # the one registered block still serves sequences that start with it


def test_a_colliding_block_with_the_same_tokens_but_another_parent_is_not_reused(monkeypatch):
    """[A, A, x] registers its first block A; under a constant hash the lookup of [A, A, y]'s second block finds
    that same block (same tokens, key 0) but as a first block, not as a child of A: only one block is reused."""
    monkeypatch.setattr(kv_blocks, "chain_hash", lambda parent, tokens: 0)
    bm, a = BlockManager(num_blocks=8, block_size=2, watermark=0), [5, 6]
    first = a + a + [7]
    bm.allocate("first", len(first), span(first))
    bm.cache("first", len(first), span(first))
    second = a + a + [8]
    assert bm.allocate("second", len(second), span(second)) == 2
    assert bm.table("second")[0] == bm.table("first")[0] and bm.table("second")[1] != bm.table("first")[1]
    bm.check()


def test_hits_stop_one_token_short_and_freed_blocks_stay_cached_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0)
    seq = list(range(10, 22))  # 12 tokens: 3 full blocks
    bm.allocate("a", 12, span(seq))
    bm.cache("a", 12, span(seq))
    table = list(bm.table("a"))
    bm.free("a")
    assert bm.num_free == 6
    assert bm.allocate("b", 12, span(seq)) == 8  # at most 11 tokens: two whole blocks, the third computed again
    assert bm.table("b")[:2] == table[:2] and bm.table("b")[2] != table[2]
    bm.free("b")
    bm.allocate("c", 16, span(list(range(100, 116))))  # four fresh blocks: the unregistered ones, then a's tail
    assert table[2] in bm.table("c") and not set(table[:2]) & set(bm.table("c"))
    bm.free("c")
    assert bm.allocate("d", 12, span(seq)) == 8  # a's head blocks survived the eviction
    bm.check()


def test_shared_blocks_are_counted_once_per_table():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=1)
    seq = list(range(3, 12))
    bm.allocate("a", 9, span(seq))
    bm.cache("a", 9, span(seq))
    assert bm.can_allocate(9, span(seq)) and bm.allocate("b", 9, span(seq)) == 8
    shared = bm.table("a")[:2]
    assert bm.table("b")[:2] == shared and all(bm.ref[b] == 2 for b in shared)
    assert bm.num_used == 3 + 1
    bm.free("a")
    assert all(bm.ref[b] == 1 for b in shared) and bm.num_used == 3
    bm.check()


def req(rid, prompt_len, max_new=4, first=3):
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_new_tokens=max_new,
                                                                              ignore_eos=True))


def paged(policy, num_blocks, block_size=4, watermark=1, prefix_caching=True):
    s = make_scheduler(policy_spec(policy), max_request_tokens=256)
    s.use_blocks(BlockManager(num_blocks, block_size, watermark, prefix_caching))
    return s


def step(s, now=0.0, token=7):
    plan = s.schedule(now)
    s.update(plan, RunnerOutput({c.rid: token for c in plan.chunks if c.sample}), now)
    s.blocks.check()
    return plan


@pytest.mark.parametrize("watermark, admitted", [(1, 3), (2, 2)])
def test_admission_asks_for_blocks_above_the_watermark(watermark, admitted):
    """Prompts of 12 tokens take 3 blocks of 4 each; a pool of 10 keeps `watermark` free at admission."""
    s = paged(PolicySpec.of("continuous", 8), 10, watermark=watermark)
    for i in range(4):
        s.add(req(str(i), 12, first=100 * i))
    assert len(s.schedule(0.0).new_ids) == admitted and len(s.waiting) == 4 - admitted


def test_max_running_still_caps_the_running_requests():
    s = paged(PolicySpec.of("continuous", 2), 100)
    for i in range(3):
        s.add(req(str(i), 5, first=100 * i))
    assert step(s).new_ids == ("0", "1")


def test_the_newest_running_request_is_preempted_and_resumes_with_its_output():
    """Three requests of 4-token prompts (one block each) on 5 blocks: at the 5th token each needs a second block;
    the newest gives its block up, waits at the front of the queue, then prefills prompt + output and continues."""
    s = paged(PolicySpec.of("continuous", 3), 5, watermark=0, prefix_caching=False)
    for i in range(3):
        s.add(req(str(i), 4, max_new=8, first=100 * i))
    s.add(req("late", 4, first=500))
    reqs = dict(s.requests)
    tokens = {rid: [] for rid in reqs}
    preempted, resumed = [], None
    for t in range(100):
        plan = s.schedule(float(t))
        preempted += plan.preempted_ids
        for c in plan.chunks:
            if c.rid == "2" and c.prompt and s.requests["2"].output:
                resumed = c
        sampled = {c.rid: t for c in plan.chunks if c.sample}
        for e in s.update(plan, RunnerOutput(sampled), float(t)):
            tokens.setdefault(e.rid, []).append(e.token)
        s.blocks.check()
        if not s.has_work():
            break
    assert preempted[0] == "2" and s.num_preemptions == len(preempted)
    assert resumed is not None and resumed.start == 0 and resumed.sample
    assert list(resumed.tokens[:4]) == list(range(200, 204)) and len(resumed.tokens) > 4  # prompt + its output
    assert all(tokens[rid] == r.output and len(r.output) == r.params.max_new_tokens for rid, r in reqs.items())
    assert s.blocks.num_free == 5 and not s.has_work()


def test_preempted_requests_wait_ahead_of_new_ones_oldest_first():
    """Three prompts of one block each fill a pool of 3; after their first token the oldest needs a second block:
    the newest is preempted for it, then the middle one, needing one too, preempts itself."""
    s = paged(PolicySpec.of("continuous", 4), 3, watermark=0, prefix_caching=False)
    for i in range(3):
        s.add(req(str(i), 4, max_new=8, first=100 * i))
    step(s)
    s.add(req("new", 1))
    assert [r.rid for r in s.waiting] == ["1", "2", "new"]
    assert all(r.status is Status.WAITING and r.seat is None for r in list(s.waiting)[:2])
    assert s.schedule(2.0).preempted_ids == ("2", "1")


def test_request_level_policies_refuse_paged_kv():
    for name in ("static", "dynamic", "bucketed"):
        with pytest.raises(ValueError, match=f"'{name}'.*kv=slot"):
            paged(policy_spec(name, max_running=4, max_batch=4), 16)


def sim_engine(policy, kv, max_request_tokens=256):
    clock = VirtualClock()
    return build_engine(None, policy, max_request_tokens,
                        runner=SimRunner(CostModel(0.01, {"num_prompt_tokens": 1e-4}), clock), clock=clock, kv=kv)


def test_a_request_beyond_the_pool_is_refused_at_once():
    eng = sim_engine(PolicySpec.of("continuous", 4), kv_spec("paged", num_blocks=10, block_size=4))
    assert eng.scheduler.blocks.watermark == 1
    eng.validate([5] * 30, SamplingParams(max_new_tokens=6))  # 36 tokens: 9 blocks, all the pool admits
    with pytest.raises(RequestError, match="10 KV blocks of 4; the pool can admit 9 for one request") as err:
        eng.add_request("big", [5] * 30, SamplingParams(max_new_tokens=7))
    assert err.value.field == "max_new_tokens" and not eng.has_work()


def test_kv_settings_fail_clearly():
    with pytest.raises(ValueError, match="choose one of \\['cat', 'paged', 'slot'\\]"):
        kv_spec("pages")
    with pytest.raises(ValueError, match="kv.block_size = 0"):
        kv_spec("paged", block_size=0)
    with pytest.raises(ValueError, match="no field \\['block_size'\\]"):
        kv_spec("slot", block_size=16)
    with pytest.raises(ValueError, match="memory_mb needs the model"):
        sim_engine(PolicySpec.of("continuous", 4), kv_spec("paged", memory_mb=1))
    assert kv_spec("paged").prefix_caching is True
    eng = sim_engine(PolicySpec.of("continuous", 4), kv_spec("paged"), max_request_tokens=100)
    assert eng.scheduler.blocks.num_blocks == 4 * 7 + 1  # 4 seats x 100 tokens in blocks of 16, + the watermark


@pytest.mark.parametrize("policy", [PolicySpec.of("continuous", 8), PolicySpec.of("mixed", 8),
                                    PolicySpec.of("chunked", 8, token_budget=24)],
                         ids=["continuous", "mixed", "chunked"])
def test_a_tight_pool_in_simulation_preempts_and_finishes_everything(policy):
    eng = sim_engine(policy, kv_spec("paged", num_blocks=24, block_size=4))
    rng = random.Random(1)
    reqs = [eng.add_request(str(i), list(range(3, 11)) + [rng.randint(3, 9) for _ in range(rng.randint(1, 12))],
                            SamplingParams(max_new_tokens=rng.randint(5, 40), ignore_eos=True)) for i in range(12)]
    events = {r.rid: [] for r in reqs}
    while eng.has_work():
        for e in eng.step():
            events[e.rid].append(e.token)
        eng.scheduler.blocks.check()
    assert eng.scheduler.num_preemptions > 0 and sum(r.preempted for r in eng.records) > 0
    assert all(len(events[r.rid]) == len(r.output) == r.params.max_new_tokens for r in reqs)
    assert max(r.blocks_used for r in eng.records) <= 24 and eng.scheduler.blocks.num_free == 24
    assert sum(r.cached_tokens for r in eng.records) > 0  # shared prefixes, and preempted requests' own blocks


def test_a_prefix_hit_skips_its_prompt_tokens():
    """The same 40-token prompt twice, one after the other: the second computes only what the cache lacks."""
    eng = sim_engine(PolicySpec.of("continuous", 4), kv_spec("paged", block_size=16))
    p = SamplingParams(max_new_tokens=3, ignore_eos=True)
    prompt = list(range(3, 43))
    eng.add_request("a", prompt, p)
    while eng.has_work():
        eng.step()
    eng.add_request("b", prompt, p)
    eng.add_request("c", prompt[:17] + [99] * 5, p)
    eng.take_records()
    eng.step()
    first = eng.records[0]
    assert first.cached_tokens == 32 + 16 and first.num_prompt_tokens == (40 - 32) + (22 - 16)
    while eng.has_work():
        eng.step()
    assert eng.scheduler.blocks.hit_tokens == 48
