"""The router: which replica of a fleet serves each request, from what the router itself has seen (the requests it
sent each replica and not yet seen finish, the prompts it sent each one), so that the fleet simulator and the
routing server decide alike without asking the replicas anything.

Policies (conf/server/router.yaml; the fleet report's `fleet.routers`):
  round_robin    each replica in turn
  least_loaded   the fewest outstanding tokens (prompt + tokens asked for, of requests not finished)
  power_of_two   two replicas drawn at random (seeded), the one with fewer outstanding tokens
  session        a session (conversation) sticks to the replica its first request went to; a new one: least loaded
  prefix_aware   SGLang's cache-aware rule: while the load is balanced, the replica whose sent prompts share the
                 longest prefix with this one if that covers at least `cache_threshold` of the prompt, else the
                 least loaded; when outstanding requests are out of balance (more than `balance_abs` apart and the
                 largest more than `balance_rel` x the smallest), the replica with the fewest
Replicas marked down (the routing server's health checks) are skipped by every policy; a session whose replica is down
moves to the one chosen for it instead.
The prefix index is approximate, as SGLang's router's tree is: chained hashes of `block_tokens`-token blocks of the
prompts sent each replica, the least recently used forgotten beyond `cache_tokens` tokens a replica (its K/V pool).
"""
import random
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("round_robin", "least_loaded", "power_of_two", "session", "prefix_aware")


@dataclass(frozen=True)
class RouterSpec:
    policy: str = "round_robin"
    block_tokens: int = 16          # tokens (or characters, for text) per block of the prefix index
    cache_tokens: int = 1 << 20     # tokens of prompts the index remembers per replica
    cache_threshold: float = 0.3    # prefix_aware: share of the prompt a match must cover (SGLang's default)
    balance_abs: int = 64           # prefix_aware: outstanding requests apart ... (SGLang's default)
    balance_rel: float = 1.5        # ... and this ratio: out of balance (SGLang's default)
    seed: int = 0                   # power_of_two's draws

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; choose one of {list(POLICIES)}")
        if self.block_tokens < 1 or self.cache_tokens < self.block_tokens:
            raise ValueError(f"router: block_tokens ({self.block_tokens}) must be >= 1 and cache_tokens "
                             f"({self.cache_tokens}) at least one block")
        if not 0 <= self.cache_threshold <= 1 or self.balance_abs < 0 or self.balance_rel < 1:
            raise ValueError("router: cache_threshold must be in [0, 1], balance_abs >= 0, balance_rel >= 1")


class Router:
    def __init__(self, spec: RouterSpec, replicas: int):
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {replicas}")
        self.spec, self.n = spec, replicas
        self.requests = [0] * replicas            # outstanding requests per replica
        self.tokens = [0] * replicas              # outstanding tokens per replica
        self.sent: dict[str, tuple[int, int]] = {}  # rid -> (replica, tokens)
        self.index = [OrderedDict() for _ in range(replicas)]  # per replica: block chain hash -> None, LRU first
        self.sessions: dict[str, int] = {}
        self.down: set[int] = set()               # replicas skipped (unhealthy)
        self._turn = 0
        self._rng = random.Random(spec.seed)

    def route(self, rid: str, prompt, max_tokens: int, session: str | None = None, skip=()) -> int:
        """The replica for this request (prompt: token ids or text), recorded as outstanding there; never one that is
        down or in `skip` (LookupError when that leaves none)."""
        if rid in self.sent:
            raise ValueError(f"request {rid!r} is already routed")
        live = [i for i in range(self.n) if i not in self.down and i not in skip]
        if not live:
            raise LookupError(f"no replica left to route to: {self.n - len(self.down)} of {self.n} up, "
                              f"{len(skip)} tried already")
        chains = self._chains(prompt) if self.spec.policy == "prefix_aware" else []  # only it reads the index
        to = self._choose(chains, len(prompt), session, live)
        if session is not None and self.spec.policy == "session":
            self.sessions[session] = to
        self._remember(to, chains)
        cost = len(prompt) + int(max_tokens)
        self.sent[rid] = (to, cost)
        self.requests[to] += 1
        self.tokens[to] += cost
        return to

    def finished(self, rid: str) -> None:
        """The request ended (finished, aborted or failed): no longer outstanding."""
        to, cost = self.sent.pop(rid)
        self.requests[to] -= 1
        self.tokens[to] -= cost

    def matched(self, replica: int, prompt) -> int:
        """Leading tokens of the prompt in the replica's index (whole blocks; prefix_aware keeps one)."""
        return self._match(replica, self._chains(prompt)) * self.spec.block_tokens

    def _choose(self, chains: list[int], length: int, session: str | None, live: list[int]) -> int:
        p = self.spec.policy
        if p == "round_robin":
            to = min(live, key=lambda i: (i - self._turn) % self.n)  # the next live one from the turn on
            self._turn = to + 1
            return to
        if p == "power_of_two" and len(live) > 1:
            a, b = self._rng.sample(live, 2)
            return a if (self.tokens[a], a) <= (self.tokens[b], b) else b
        if p == "session" and self.sessions.get(session) in live:
            return self.sessions[session]
        if p == "prefix_aware":
            lo, hi = min(self.requests[i] for i in live), max(self.requests[i] for i in live)
            if hi - lo > self.spec.balance_abs and hi > self.spec.balance_rel * lo:
                return min(live, key=lambda i: (self.requests[i], i))
            match = {i: self._match(i, chains) for i in live}
            best = max(live, key=lambda i: (match[i], -self.tokens[i], -i))
            if length and match[best] * self.spec.block_tokens >= self.spec.cache_threshold * length:
                return best
        return min(live, key=lambda i: (self.tokens[i], i))

    def _chains(self, prompt) -> list[int]:
        """The chained hash of each whole block of the prompt."""
        bs, key, out = self.spec.block_tokens, 0, []
        for b in range(len(prompt) // bs):
            key = hash((key, tuple(prompt[b * bs:(b + 1) * bs])))
            out.append(key)
        return out

    def _match(self, replica: int, chains: list[int]) -> int:
        index, n = self.index[replica], 0
        for key in chains:
            if key not in index:
                break
            n += 1
        return n

    def _remember(self, replica: int, chains: list[int]) -> None:
        index = self.index[replica]
        for key in chains:
            index[key] = None
            index.move_to_end(key)
        while len(index) * self.spec.block_tokens > self.spec.cache_tokens:
            index.popitem(last=False)
