"""Paged KV per layer type: a model whose layers' windows differ (sliding layers and full ones) keeps one
BlockManager pool per window, each request a table in each (vLLM's hybrid allocator, llama.cpp's SWA cache); a
windowed pool holds a sequence's window only (engine/core/kv_blocks.py, `slide`). The memory math of a seat, shared
with probe_hardware's seats that fit: each layer its window's blocks."""
from engine.core.kv_blocks import BlockManager, Tokens, needs_bytes


def kept_blocks(window: int | None, context: int, block_size: int) -> int:
    """Blocks a decoding sequence of `context` tokens holds in a pool of this window: its next token's window spans
    at most blocks_for(window) + 1 of them; a full layer's pool holds them all."""
    whole = -(-context // block_size)
    return whole if window is None else min(whole, -(-window // block_size) + 1)


def seat_bytes(layer_windows: list, context: int, layer_token_bytes: int, block_size: int) -> int:
    """K/V bytes one decoding sequence of `context` tokens holds, each layer its window's blocks (paged)."""
    return sum(kept_blocks(w, context, block_size) for w in layer_windows) * block_size * layer_token_bytes


class LayerPools:
    """Paged KV for a model whose layers' windows differ: one BlockManager per window (None: the full layers), each
    request a table in each. Admission, growth, registration and freeing act on every pool; a prefix-cache hit is
    the blocks every pool holds. Counts (num_blocks, num_used, num_free) are in blocks of every layer's K/V: each
    pool's weighted by its share of the layers."""

    def __init__(self, pools: dict, layer_windows: list):
        self.pools, self.layer_windows = pools, list(layer_windows)  # window -> BlockManager; each layer's window
        first = next(iter(pools.values()))
        self.block_size, self.prefix_caching = first.block_size, first.prefix_caching
        self._share = {w: self.layer_windows.count(w) / len(self.layer_windows) for w in pools}
        self.queried_tokens = self.hit_tokens = 0

    @classmethod
    def sized(cls, kv, num_seats: int, max_request_tokens: int, kv_bytes_per_token: int | None,
              layer_windows: list) -> "LayerPools":
        """The pools a paged KV record (engine.specs.KVSpec) asks for. Seats: num_seats (none given), kv.num_blocks /
        the blocks of one max_request_tokens sequence, or memory_mb over the bytes a seat keeps (each windowed pool its
        window's blocks plus one, the full pool the whole sequence). Each pool holds its seats' blocks, a windowed pool
        also one whole sequence more (a prompt's blocks while it is prefilled), and its watermark."""
        bs, wm = int(kv.block_size), float(kv.watermark)
        whole = -(-max_request_tokens // bs)
        keep = {w: kept_blocks(w, max_request_tokens, bs) for w in dict.fromkeys(layer_windows)}
        layers = {w: layer_windows.count(w) for w in keep}
        extra = {w: whole - keep[w] for w in keep}  # one prompt prefilled whole
        if kv.num_blocks is not None:
            seats = int(kv.num_blocks) / whole
        elif kv.memory_mb is not None:
            block = bs * needs_bytes(kv_bytes_per_token) / len(layer_windows)  # bytes of one layer's block
            budget = kv.memory_mb * 2**20 / block - sum(layers[w] * (extra[w] + (w is not None)) for w in keep)
            seats = budget / sum(layers[w] * keep[w] for w in keep)
            if seats < 1:
                need = sum(layers[w] * (keep[w] + extra[w] + (w is not None)) for w in keep)  # layer blocks
                raise ValueError(f"kv.memory_mb = {kv.memory_mb} MiB holds no request of {max_request_tokens} "
                                 f"tokens (a seat per window, and one whole prompt in each windowed pool): give at "
                                 f"least {int(need * block / 2**20) + 1} MiB or a smaller max_request_tokens")
        else:
            seats = num_seats
        pools = {}
        for w in keep:
            n = int(seats * keep[w]) + extra[w]
            n += (kv.memory_mb is None and kv.num_blocks is None) * max(1, int(wm * n)) + (w is not None)
            pools[w] = BlockManager(n, bs, max(1, int(wm * n)), bool(kv.prefix_caching), w)
        return cls(pools, layer_windows)

    def _weighted(self, count) -> int:
        return round(sum(self._share[w] * count(p) for w, p in self.pools.items()))

    @property
    def num_blocks(self) -> int:
        return self._weighted(lambda p: p.num_blocks)

    @property
    def num_used(self) -> int:
        return self._weighted(lambda p: p.num_used)

    @property
    def num_free(self) -> int:
        return self._weighted(lambda p: p.num_free)

    @property
    def admissible(self) -> int:
        return min(p.admissible for p in self.pools.values())

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def layer_blocks(self) -> list[int]:
        """Each layer's pool size (its cache tensor's blocks)."""
        return [self.pools[w].num_blocks for w in self.layer_windows]

    @property
    def main(self):
        """The window of the pool whose table is a request's `table`: the full layers' (None), else the first."""
        return None if None in self.pools else next(iter(self.pools))

    def table(self, rid: str) -> list[int]:
        return self.pools[self.main].table(rid)

    def tables(self, rid: str) -> dict:
        """Window -> the request's table in that pool."""
        return {w: tuple(p.table(rid)) for w, p in self.pools.items()}

    def _hits(self, num_tokens: int, tokens: Tokens) -> int:
        return min(p.hits(num_tokens, tokens) for p in self.pools.values())

    def can_allocate(self, num_tokens: int, tokens: Tokens) -> bool:
        most = self._hits(num_tokens, tokens)
        return all(p.can_allocate(num_tokens, tokens, most) for p in self.pools.values())

    def allocate(self, rid: str, num_tokens: int, tokens: Tokens) -> int:
        most = self._hits(num_tokens, tokens)
        got = {p.allocate(rid, num_tokens, tokens, most) for p in self.pools.values()}
        self.queried_tokens += num_tokens
        self.hit_tokens += most * self.block_size
        assert got == {most * self.block_size}, "every pool takes the common hit"
        return most * self.block_size

    def grow(self, rid: str, num_tokens: int) -> bool:
        """Every pool's table holds num_tokens, or none changes (False)."""
        if any(p.blocks_for(num_tokens) - len(p.table(rid)) > p.num_free for p in self.pools.values()):
            return False
        return all([p.grow(rid, num_tokens) for p in self.pools.values()])

    def shrink(self, rid: str, num_tokens: int) -> None:
        for p in self.pools.values():
            p.shrink(rid, num_tokens)

    def cache(self, rid: str, num_computed: int, tokens: Tokens) -> None:
        for p in self.pools.values():
            p.cache(rid, num_computed, tokens)

    def slide(self, rid: str, num_computed: int) -> None:
        for p in self.pools.values():
            p.slide(rid, num_computed)

    def free(self, rid: str) -> None:
        for p in self.pools.values():
            p.free(rid)

    def check(self) -> None:
        for p in self.pools.values():
            p.check()
        assert len({frozenset(p._tables) for p in self.pools.values()}) == 1, "every pool holds the same requests"


def make_pools(kv, num_seats: int, max_request_tokens: int, kv_bytes_per_token: int | None,
               layer_windows: list | None = None) -> BlockManager | LayerPools:
    """The paged KV a KV record asks for, for a model whose layers attend `layer_windows` (None: a model-free
    simulation, every layer full): one pool where every layer shares a window (or none), else LayerPools."""
    windows = list(dict.fromkeys(layer_windows or [None]))
    if len(windows) == 1:
        return BlockManager.sized(kv, num_seats, max_request_tokens, kv_bytes_per_token, windows[0])
    return LayerPools.sized(kv, num_seats, max_request_tokens, kv_bytes_per_token, list(layer_windows))
