"""KV caches: `rows` gives the flat cache rows of this step's tokens, `write` stores their K/V there in place.

SlotCache: one preallocated seat (a row of positions) per running request, written in place; `view` the first
  seats, `gather` any seats.
CatCache: the growing cache of a naive engine, extended with torch.cat whenever a step needs more length.
PagedCache: a fixed pool of blocks shared by all requests (engine.core.kv_blocks hands them out); `gather` reads each
  sequence's keys through its block table. Where layers' windows differ (LayerPools), each layer's blocks are its
  window's pool's: a windowed layer holds fewer.
"""
import torch


class SlotCache:
    def __init__(self, num_layers: int, num_seats: int, seat_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        shape = (num_seats, num_kv_heads, seat_len, head_dim)  # [seat, kv head, position, dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seat_len = seat_len
        self._heads = torch.arange(num_kv_heads, device=device)[None, :]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def rows(self, seats: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row index [T * kv heads] of each (token, kv head) in a [seat * head * position, dim] view."""
        heads, cap = self._heads.shape[1], self.seat_len
        return ((seats[:, None] * heads + self._heads) * cap + positions[:, None]).view(-1)

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops=None):
        """k, v: [T, kv heads, dim], stored at `rows` in the cache's dtype. ops: the native kernels
        (engine/kernels/build.py), which copy strided k and v without first making them contiguous."""
        D = k.shape[-1]
        if ops is not None:
            ops.write_rows_(self.k[layer].view(-1, D), rows, k)
            ops.write_rows_(self.v[layer].view(-1, D), rows, v)
            return
        self.k[layer].view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(self.k[layer].dtype))
        self.v[layer].view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.v[layer].dtype))

    def view(self, layer: int, num_seats: int, length: int):
        """K, V of seats [0, num_seats) up to `length` positions, as views (no copy)."""
        return self.k[layer][:num_seats, :, :length], self.v[layer][:num_seats, :, :length]

    def gather(self, layer: int, seats: torch.Tensor, length: int):
        """K, V of the given seats up to `length` positions (a copy)."""
        return self.k[layer][seats, :, :length], self.v[layer][seats, :, :length]


class CatCache(SlotCache):
    """Starts empty and grows by torch.cat along positions, copying the whole cache each time."""

    def __init__(self, num_layers: int, num_seats: int, seat_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        super().__init__(num_layers, num_seats, 0, num_kv_heads, head_dim, dtype, device)
        self.seat_len = seat_len
        self.copied_bytes = 0  # bytes copied by torch.cat since construction

    def rows(self, seats, positions):
        self._need = int(positions.max()) + 1  # the length this step's writes reach
        self._pos, self._seats = positions, seats
        return super().rows(seats, positions)

    def _grow(self, layer: int, length: int):
        have = self.k[layer].shape[2]
        if length <= have:
            return
        pad = list(self.k[layer].shape)
        pad[2] = length - have
        for store in (self.k, self.v):
            old = store[layer]
            store[layer] = torch.cat([old, old.new_zeros(pad)], dim=2)
            self.copied_bytes += old.numel() * old.element_size()

    def write(self, layer, rows, k, v, ops=None):
        self._grow(layer, self._need)
        heads, cap = self._heads.shape[1], self.k[layer].shape[2]  # rows move as the cache grows
        rows = ((self._seats[:, None] * heads + self._heads) * cap + self._pos[:, None]).view(-1)
        D = k.shape[-1]
        self.k[layer].view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(self.k[layer].dtype))
        self.v[layer].view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.v[layer].dtype))


class PagedCache(SlotCache):
    """A pool of blocks of `block_size` positions; a request's K/V live in the blocks its table lists, in order.
    Stored like a slot cache with one row per block: [block, kv head, offset, dim]."""

    def __init__(self, num_layers: int, num_blocks: int | list[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        """num_blocks: every layer's, or each layer's (LayerPools)."""
        per_layer = num_blocks if isinstance(num_blocks, list) else [num_blocks] * num_layers
        super().__init__(num_layers, 0, block_size, num_kv_heads, head_dim, dtype, device)
        shape = (num_kv_heads, block_size, head_dim)  # per block: [kv head, offset, dim]
        self.k = [torch.zeros((n, *shape), dtype=dtype, device=device) for n in per_layer]
        self.v = [torch.zeros((n, *shape), dtype=dtype, device=device) for n in per_layer]
        self.block_size = block_size
        self._offsets = torch.arange(block_size, device=device)

    def rows(self, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows of each (token, kv head); blocks: [T] the block holding each token's position."""
        return super().rows(blocks, positions % self.block_size)

    def keys(self, tables: torch.Tensor) -> torch.Tensor:
        """Flat rows [B, kv heads, nb * block_size] of the positions held by block tables [B, nb]."""
        heads, bs = self._heads.shape[1], self.block_size
        rows = (tables[:, None, :, None] * heads + self._heads.view(1, -1, 1, 1)) * bs + self._offsets
        return rows.view(tables.shape[0], heads, -1)

    def gather(self, layer: int, keys: torch.Tensor):
        """K, V [B, kv heads, L, dim] at the rows `keys` [B, kv heads, L] gives (a copy)."""
        D = self.k[layer].shape[-1]
        flat = keys.view(-1)
        return (self.k[layer].view(-1, D).index_select(0, flat).view(*keys.shape, D),
                self.v[layer].view(-1, D).index_select(0, flat).view(*keys.shape, D))


def make_cache(name: str, net, num_seats: int, max_request_tokens: int, blocks=None):
    """The KV cache a conf/kv name asks for, for a FlatModel: `num_seats` seats of max_request_tokens positions
    (slot; cat's rows grow up to that length), or the pool of an engine.core.kv_blocks.BlockManager (paged)."""
    shape = (net.num_kv_heads, net.head_dim, net.kv_dtype, net.device)
    if name == "paged":
        per_layer = blocks.layer_blocks() if hasattr(blocks, "layer_blocks") else blocks.num_blocks
        return PagedCache(net.num_layers, per_layer, blocks.block_size, *shape)
    return {"slot": SlotCache, "cat": CatCache}[name](net.num_layers, num_seats, max_request_tokens, *shape)
