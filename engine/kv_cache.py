"""KV caches behind one interface: `write` the step's new K/V, `view` the first seats, `gather` any seats.

SlotCache: one preallocated row per seat, written in place; its size never changes.
CatCache: the growing cache of a naive engine, extended with torch.cat whenever a step needs more length.
"""
import torch


class SlotCache:
    def __init__(self, num_layers: int, num_seats: int, seat_tokens: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        shape = (num_seats, num_kv_heads, seat_tokens, head_dim)  # [seat, kv head, position, dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seat_tokens = seat_tokens
        self._heads = torch.arange(num_kv_heads, device=device)[None, :]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots(self, seats: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row index [T * kv heads] of each (token, kv head) in a [seat * head * position, dim] view."""
        heads, cap = self._heads.shape[1], self.seat_tokens
        return ((seats[:, None] * heads + self._heads) * cap + positions[:, None]).view(-1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v: [T, kv heads, dim], stored at the rows `slots` gives."""
        D = k.shape[-1]
        self.k[layer].view(-1, D).index_copy_(0, slots, k.reshape(-1, D))
        self.v[layer].view(-1, D).index_copy_(0, slots, v.reshape(-1, D))

    def view(self, layer: int, num_seats: int, length: int):
        """K, V of seats [0, num_seats) up to `length` positions, as views (no copy)."""
        return self.k[layer][:num_seats, :, :length], self.v[layer][:num_seats, :, :length]

    def gather(self, layer: int, seats: torch.Tensor, length: int):
        """K, V of the given seats up to `length` positions (a copy)."""
        return self.k[layer][seats, :, :length], self.v[layer][seats, :, :length]


class CatCache(SlotCache):
    """Starts empty and grows by torch.cat along positions, copying the whole cache each time (seed 003 §3)."""

    def __init__(self, num_layers: int, num_seats: int, seat_tokens: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        super().__init__(num_layers, num_seats, 0, num_kv_heads, head_dim, dtype, device)
        self.seat_tokens = seat_tokens
        self.copied_bytes = 0  # bytes copied by torch.cat since construction

    def slots(self, seats, positions):
        self._need = int(positions.max()) + 1  # the length this step's writes reach
        self._pos, self._seats = positions, seats
        return super().slots(seats, positions)

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

    def write(self, layer, slots, k, v):
        self._grow(layer, self._need)
        heads, cap = self._heads.shape[1], self.k[layer].shape[2]  # rows move as the cache grows
        rows = ((self._seats[:, None] * heads + self._heads) * cap + self._pos[:, None]).view(-1)
        D = k.shape[-1]
        self.k[layer].view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
        self.v[layer].view(-1, D).index_copy_(0, rows, v.reshape(-1, D))
