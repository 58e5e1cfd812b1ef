"""The paged KV cache's bookkeeping, model-free: a fixed pool of blocks of `block_size` tokens, one block table per
request that grows (its K/V in those blocks, in order; a rejected draft's blocks are given back), reference counts,
and prefix caching.

Prefix caching: a block full of computed tokens is registered under a chain hash (its parent's hash and its own
tokens). A new sequence takes the longest chain of registered blocks that matches its first tokens, verified
against each block's stored tokens and its parent (named by a registration serial, never reused), so a hash
collision cannot cause a wrong reuse. A freed block keeps its registration in an LRU free queue until it is taken
for new tokens: blocks without one go first, and a request's tail blocks are queued ahead of its head.

Sliding windows: a pool whose layers attend only the last `window` positions releases a running sequence's blocks
once they lie wholly before the window of its next token (`slide`); its table keeps NULL_BLOCK in their place (a
reserved block never handed out, read only under a mask), so a table's i-th entry is still positions [i bs, (i+1) bs).
A model whose layers' windows differ keeps a pool per window: engine/core/kv_pools.py.
"""
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

Tokens = Callable[[int, int], Sequence[int]]  # (start, end) -> the sequence's tokens at those positions
NULL_BLOCK = 0  # a windowed pool's table entry for positions its window has left (reserved in such a pool)


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A block's key: its parent's key (None for a sequence's first block) and its own tokens."""
    return hash((parent, tokens))


@dataclass(frozen=True)
class Entry:
    """A registered block."""
    key: int                   # chain hash
    serial: int                # unique per registration: its children name it as their parent
    parent: int | None         # serial of the block before it; None for a sequence's first block
    tokens: tuple[int, ...]


@dataclass
class BlockTable:
    """A request's blocks and how far its chain of full blocks has been registered."""
    blocks: list[int]
    full: int = 0              # leading blocks registered (or found registered already)
    key: int | None = None     # chain hash of block full - 1
    serial: int | None = None  # serial its next block names as parent
    slid: int = 0              # leading blocks released by a sliding window (NULL_BLOCK in `blocks`)


def needs_bytes(kv_bytes_per_token: int | None) -> int:
    """A pool sized in MiB needs the model's KV bytes per token."""
    if kv_bytes_per_token is None:
        raise ValueError("kv.memory_mb needs the model's KV bytes per token; without a model (a simulation) give "
                         "kv.num_blocks")
    return kv_bytes_per_token


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, watermark: int = 1, prefix_caching: bool = True,
                 window: int | None = None):
        """watermark: blocks that admitting a new sequence must leave free (running requests may use them); window:
        the pool's layers attend the last `window` positions (None: all), NULL_BLOCK then reserved."""
        reserved = 0 if window is None else 1
        if block_size < 1 or watermark < 0 or num_blocks - reserved <= watermark or (window is not None and window < 1):
            raise ValueError(f"a pool of {num_blocks} blocks of {block_size} tokens with {watermark} kept free at "
                             f"admission{' and one reserved' if reserved else ''} holds nothing: need block_size >= 1, "
                             "num_blocks > watermark >= 0 (and window >= 1)")
        self.num_blocks, self.reserved, self.block_size, self.window = num_blocks, reserved, block_size, window
        self.watermark, self.prefix_caching = watermark, prefix_caching
        self.ref = [0] * num_blocks                               # block -> tables holding it (NULL_BLOCK: none)
        self._free = OrderedDict.fromkeys(range(reserved, num_blocks))  # unreferenced blocks; taken from the front
        self._tables: dict[str, BlockTable] = {}                       # rid -> its table
        self._entry: dict[int, Entry] = {}                        # registered block -> its entry
        self._by_key: dict[int, int] = {}                         # chain hash -> registered block
        self._serial = 0
        self.queried_tokens = 0    # tokens of the sequences allocated, over all allocations
        self.hit_tokens = 0        # of which found in the prefix cache (K/V not computed again)

    @classmethod
    def sized(cls, kv, num_seats: int, max_request_tokens: int, kv_bytes_per_token: int | None,
              window: int | None = None) -> "BlockManager":
        """The pool a paged KV record (engine.specs.KVSpec) asks for: num_blocks; else memory_mb (MiB) /
        (block_size x the model's KV bytes per token); else the slot cache's size (num_seats x max_request_tokens)
        plus the watermark. Admission keeps the watermark fraction of the blocks free, at least one."""
        bs = int(kv.block_size)
        if kv.num_blocks is not None:
            n = int(kv.num_blocks)
        elif kv.memory_mb is not None:
            n = int(kv.memory_mb * 2**20 // (bs * needs_bytes(kv_bytes_per_token)))
        else:  # every running request's worst case, and the watermark on top, so that all of them can be admitted
            n = num_seats * -(-max_request_tokens // bs)
            n += max(1, int(kv.watermark * n)) + (window is not None)
        return cls(n, bs, max(1, int(kv.watermark * n)), bool(kv.prefix_caching), window)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.reserved - len(self._free)

    @property
    def admissible(self) -> int:
        """The most blocks one sequence can be admitted with: all but the reserved and the watermark."""
        return self.num_blocks - self.reserved - self.watermark

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, rid: str) -> list[int]:
        return self._tables[rid].blocks

    # --- admission -------------------------------------------------------------------------
    def _match(self, num_tokens: int, tokens: Tokens, most: int | None = None) -> tuple[list[int], int | None,
                                                                                        int | None]:
        """The registered chain matching the sequence's first full blocks, at most num_tokens - 1 tokens (one is
        always computed) and `most` blocks: (blocks, chain hash and serial of the last)."""
        blocks, key, serial = [], None, None
        if not self.prefix_caching:
            return blocks, key, serial
        bs, limit = self.block_size, (num_tokens - 1) // self.block_size
        for i in range(limit if most is None else min(most, limit)):
            span = tuple(tokens(i * bs, (i + 1) * bs))
            k = chain_hash(key, span)
            e = self._entry.get(self._by_key.get(k))
            if e is None or e.tokens != span or e.parent != serial:
                break
            blocks.append(self._by_key[k])
            key, serial = k, e.serial
        return blocks, key, serial

    def hits(self, num_tokens: int, tokens: Tokens) -> int:
        """Blocks of the sequence's first tokens found in the prefix cache."""
        return len(self._match(num_tokens, tokens)[0])

    def can_allocate(self, num_tokens: int, tokens: Tokens, most: int | None = None) -> bool:
        """Room for a new sequence of num_tokens: its blocks less the cached hits (at most `most`), taken from the
        free queue (hits resting there included), leaving `watermark` blocks free."""
        hits, _, _ = self._match(num_tokens, tokens, most)
        taken = self.blocks_for(num_tokens) - len(hits) + sum(1 for b in hits if self.ref[b] == 0)
        return self.num_free - taken >= self.watermark

    def allocate(self, rid: str, num_tokens: int, tokens: Tokens, most: int | None = None) -> int:
        """A table holding a new sequence of num_tokens (after can_allocate), at most `most` of its blocks taken from
        the prefix cache; returns the tokens found cached."""
        hits, key, serial = self._match(num_tokens, tokens, most)
        for b in hits:
            if self.ref[b] == 0:
                del self._free[b]
            self.ref[b] += 1
        fresh = [self._take() for _ in range(self.blocks_for(num_tokens) - len(hits))]
        self._tables[rid] = BlockTable(hits + fresh, len(hits), key, serial)
        self.queried_tokens += num_tokens
        self.hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def _take(self) -> int:
        """The front of the free queue, its registration dropped (evicted from the prefix cache)."""
        b, _ = self._free.popitem(last=False)
        e = self._entry.pop(b, None)
        if e is not None:
            del self._by_key[e.key]
        self.ref[b] = 1
        return b

    # --- a running sequence ----------------------------------------------------------------
    def grow(self, rid: str, num_tokens: int) -> bool:
        """Extend the table to hold num_tokens; False, changing nothing, when too few blocks are free."""
        blocks = self._tables[rid].blocks
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > len(self._free):
            return False
        blocks.extend(self._take() for _ in range(need))
        return True

    def shrink(self, rid: str, num_tokens: int) -> None:
        """Release the table's blocks past those holding num_tokens (a rejected draft's: never registered)."""
        t = self._tables[rid]
        while len(t.blocks) > max(self.blocks_for(num_tokens), t.slid, t.full):
            self._release(t.blocks.pop())

    def cache(self, rid: str, num_computed: int, tokens: Tokens) -> None:
        """Register the table's blocks that are full of computed tokens and not yet registered."""
        t, bs = self._tables[rid], self.block_size
        while self.prefix_caching and t.full < num_computed // bs:
            span = tuple(tokens(t.full * bs, (t.full + 1) * bs))
            key = chain_hash(t.key, span)
            e = self._entry.get(self._by_key.get(key))
            if e is None:
                self._serial += 1
                b = t.blocks[t.full]
                self._entry[b] = Entry(key, self._serial, t.serial, span)
                self._by_key[key] = b
                t.serial = self._serial
            elif e.tokens == span and e.parent == t.serial:  # computed twice (admitted together): follow the first
                t.serial = e.serial
            else:  # a hash collision: nothing can match this chain past here
                self._serial += 1
                t.serial = self._serial
            t.key, t.full = key, t.full + 1

    def slide(self, rid: str, num_computed: int) -> None:
        """A windowed pool: release the table's blocks wholly before the window of its next token (at position
        num_computed), NULL_BLOCK in their place; nothing without a window."""
        if self.window is None:
            return
        t = self._tables[rid]
        first = max(0, num_computed + 1 - self.window) // self.block_size  # blocks before it are out of every window
        for i in range(t.slid, min(first, len(t.blocks))):
            self._release(t.blocks[i])
            t.blocks[i] = NULL_BLOCK
        t.slid = max(t.slid, min(first, len(t.blocks)))

    def _release(self, b: int) -> None:
        """One table fewer holds block b; unheld, it joins the free queue: at the tail when registered (evicted
        last), else at the front (taken first)."""
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self._free[b] = None
            if b not in self._entry:
                self._free.move_to_end(b, last=False)

    def free(self, rid: str) -> None:
        """Drop a request's table. Blocks no one else holds join the free queue tail first (so they are evicted
        before its head); unregistered ones go to the front (taken first)."""
        t = self._tables.pop(rid)
        for b in reversed(t.blocks[t.slid:]):
            self._release(b)

    def check(self) -> None:
        """Assert the pool's invariants."""
        held = Counter(b for t in self._tables.values() for b in t.blocks[t.slid:])
        assert all(set(t.blocks[:t.slid]) <= {NULL_BLOCK} for t in self._tables.values()), "slid entries are null"
        assert not self.reserved or (self.ref[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free), "null: unheld"
        assert sum(self.ref) == sum(held.values()), "reference counts sum to the table entries"
        assert all(self.ref[b] == held[b] for b in range(self.num_blocks)), "each block's count = tables holding it"
        assert all((self.ref[b] == 0) == (b in self._free) for b in range(self.reserved, self.num_blocks)), \
            "free = unreferenced"
        assert self.num_free + sum(1 for r in self.ref if r) == self.num_blocks - self.reserved, "free + used = all"
        assert len(self._by_key) == len(self._entry), "one key per registered block"
        assert all(self._by_key[e.key] == b for b, e in self._entry.items()), "each key names its block"
        assert all(len(set(t.blocks[t.slid:])) == len(t.blocks) - t.slid and t.full <= len(t.blocks)
                   for t in self._tables.values())
