"""Speculative decoding's scheduling half, model-free: which decode rows carry drafts this step and how many tokens
each, and what verification accepted (vLLM's spec-decode counters).

A drafted row is one chunk of k + 1 tokens: its last sampled token and k drafted ones, verified in the step's one
forward pass beside the other rows (engine/model/runner.py). Drafts are point proposals (greedy draft models,
prompt lookup), so verification is exact: a greedy row keeps the drafts its argmax agrees with, a sampled row keeps
draft d with probability p(d) and otherwise samples from p without d (rejection sampling against a point mass).

The speculation length is fixed (k_max, or fewer where a row has less to propose or less room), or adaptive: each
step the one k in [0, k_max] for all rows that maximises the expected tokens per second of the whole step, from the
step-time cost model (engine/core/simulator.py) and each request's measured acceptance rate (SmartSpec's goodput
rule, arXiv 2406.14066). At a large batch, where extra rows cost as much as new users, it chooses 0 by itself.
"""
import math
from collections import Counter

from engine.core.outputs import ScheduledChunk, step_features

PRIOR = 4  # trials: a request's acceptance starts as this many at the engine's rate, the engine's at 0.5


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram`): the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, trying n = prompt_lookup_max down to prompt_lookup_min. Each request's n-grams are indexed as its
    tokens arrive (n-gram -> where its latest occurrence ends), so a proposal costs a few dictionary lookups."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._index: dict[str, tuple[dict, list[int]]] = {}  # rid -> (n-gram -> last end position, [indexed up to])

    def propose(self, req, k: int) -> tuple[int, ...]:
        length = req.num_tokens
        index, done = self._index.setdefault(req.rid, ({}, [0]))
        base = max(0, done[0] + 1 - self.hi)  # the first position a new n-gram or the suffix reads
        seq = req.tokens(base, length)
        for end in range(done[0], length - 1):  # n-grams ending before the last token: earlier occurrences
            for n in range(self.lo, min(self.hi, end + 1) + 1):
                index[tuple(seq[end + 1 - n - base:end + 1 - base])] = end
        done[0] = max(done[0], length - 1)
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            end = index.get(tuple(seq[-n:]))
            if end is not None:
                return tuple(req.tokens(end + 1, end + 1 + k))
        return ()

    def forget(self, rid: str) -> None:
        self._index.pop(rid, None)


class Speculation:
    """Drafts for a step's decode rows and the counters of what was drafted and accepted."""

    def __init__(self, drafter, k_max: int, adaptive: bool = False, cost=None):
        """drafter: propose(request, k) -> up to k tokens, forget(rid); cost: a step-time model (predict(features)),
        needed when adaptive."""
        if k_max < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k_max}")
        if adaptive and cost is None:
            raise ValueError("adaptive speculation needs a step-time cost model")
        self.drafter, self.k_max, self.adaptive, self.cost = drafter, k_max, adaptive, cost
        self.num_asked = 0             # decode rows with room to draft, asked for a proposal
        self.num_drafts = 0            # rows verified with at least one draft
        self.num_draft_tokens = 0      # tokens drafted and verified
        self.num_accepted = 0          # of which accepted
        self.num_cut = 0               # rows whose draft a rejection cut (the rest kept every draft)
        self.accepted_per_pos = [0] * k_max  # position i: drafts accepted at that place in their row
        self.chosen_k: Counter = Counter()  # adaptive: k -> steps that chose it
        self._rates: dict[str, tuple[int, int]] = {}  # rid -> (drafts kept, rows cut by a rejection)

    @property
    def acceptance(self) -> float:
        """The chance a drafted token is kept once the ones before it were: kept / (kept + cuts), the geometric
        model's estimate (the simulator's acceptance)."""
        return self.num_accepted / max(1, self.num_accepted + self.num_cut)

    def rate(self, rid: str) -> float:
        """The request's acceptance (as `acceptance`) so far, drawn toward the engine's, itself drawn toward 0.5."""
        overall = (self.num_accepted + PRIOR * 0.5) / (self.num_accepted + self.num_cut + PRIOR)
        kept, cut = self._rates.get(rid, (0, 0))
        return (kept + PRIOR * overall) / (kept + cut + PRIOR)

    def drafts(self, chunks: list[ScheduledChunk], requests: dict, budget: int | None = None) -> dict[str, tuple]:
        """rid -> draft for the step's decode rows: each row's proposal cut to its room (output tokens left after
        the one it samples anyway), to k (fixed k_max or the adaptive choice), and to `budget` tokens in all (the
        step's token budget left, None: no limit), in row order. Penalized rows are not drafted."""
        offers = {}
        for c in chunks:
            req = requests[c.rid]
            if c.prompt or c.zombie or not c.sample or len(c.tokens) != 1 or req.params.penalized:
                continue
            room = min(self.k_max, req.params.max_new_tokens - len(req.output) - 1)
            if room > 0:
                self.num_asked += 1
                proposal = self.drafter.propose(req, room)
                if proposal:
                    offers[c.rid] = proposal
        if not offers:
            return {}
        k = self._choose(chunks, offers) if self.adaptive else self.k_max
        out, left = {}, math.inf if budget is None else budget
        for rid, proposal in offers.items():
            take = min(k, len(proposal), left)
            if take > 0:
                out[rid] = proposal[:take]
                left -= take
        return out

    def _choose(self, chunks: list[ScheduledChunk], offers: dict[str, tuple]) -> int:
        """The k maximising expected tokens per second: sum over rows of 1 + a + ... + a^k (a: the row's rate, k cut
        to its proposal) over the cost model's time for the step with those drafts."""
        rates = {rid: self.rate(rid) for rid in offers}
        kept = sum(1 for c in chunks if c.sample and not c.zombie)
        best, best_k = -1.0, 0
        for k in range(self.k_max + 1):
            tokens = kept + sum(sum(rates[rid] ** j for j in range(1, min(k, len(p)) + 1)) for rid, p in offers.items())
            features = step_features(chunks, {rid: min(k, len(p)) for rid, p in offers.items()})
            speed = tokens / max(self.cost.predict(features), 1e-9)
            if speed > best * (1 + 1e-9):
                best, best_k = speed, k
        self.chosen_k[best_k] += 1
        return best_k

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        """A verified row: `accepted` of its `drafted` tokens kept."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted += accepted
        self.num_cut += accepted < drafted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        kept, cut = self._rates.get(rid, (0, 0))
        self._rates[rid] = (kept + accepted, cut + (accepted < drafted))

    def forget(self, rid: str) -> None:
        self._rates.pop(rid, None)
        self.drafter.forget(rid)
