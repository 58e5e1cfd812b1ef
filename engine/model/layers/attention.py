"""A step's attention, one small type per path; the runner builds the one the step needs, every layer calls its
`attend`. Softmax runs in fp32 whatever the cache's dtype; keys and values are read back from the cache in the
activations' dtype (a bf16 cache under fp32 activations: exactly); no path loops over sequences.

DenseDecode: decodes only, token i in seat i of a slot cache: one call against a view of the first seats.
EqualPrompts: whole prompts of one length that no window cuts: the step's own q, k, v are the grid (SDPA, causal).
Spans: each token against its own keys, read in place (the native CPU kernel): a slot cache's seat or a paged
  sequence's block rows, from the window's start (or 0) to itself.
Padded: any step with torch's operators: decodes against a view of the seats (or their keys gathered through their
  block tables), prompt chunks padded to the longest against a gather of their keys.
ByLayer: layers of different windows (sliding and full layers in one model): each layer the path of its window.

The sliding-window rule is `window_start`; every mask and span the runner builds reads it.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def window_start(position, window: int | None):
    """The first key a query at `position` attends (an int, or a tensor of positions): a query attends the keys at
    positions [window_start, position], the last `window` of them (itself included), every earlier one when window
    is None."""
    if window is None:
        return 0
    start = position + 1 - window
    return start.clamp(min=0) if isinstance(start, torch.Tensor) else max(0, start)


def decode(net, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence [S, H, D] against its keys k, v [S, KV, L, D] (a seat view or a gather): the native
    kernel where the net has it (q may be strided; masked keys are never read), else two batched matmuls."""
    S, KV, L, D = k.shape
    if net.ops is not None:
        return net.ops.decode_attention(q, k, v, None if bias is None else bias.view(S, L), net.attn_scale)
    k, v = k.to(q.dtype), v.to(q.dtype)  # no copy unless the cache holds another dtype
    k, v = k.view(S * KV, L, D), v.view(S * KV, L, D)  # no copy
    scores = torch.bmm(q.contiguous().view(S * KV, -1, D), k.transpose(1, 2))    # [S * KV, H/KV, L]
    if net.attn_scale != 1.0:
        scores.mul_(net.attn_scale)
    if bias is not None:
        scores.view(S, KV, -1, L).add_(bias)
    return torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v).view(S, net.num_heads, D)


@dataclass
class DenseDecode:
    num_seats: int                     # the view covers seats [0, num_seats)
    length: int                        # and positions [0, length): the longest decoding context
    bias: torch.Tensor | None = None   # [S, 1, 1, L] additive: 0 attends, -inf masked; None: nothing masked

    def attend(self, net, layer: int, q, k, v, cache) -> torch.Tensor:
        return decode(net, q, *cache.view(layer, self.num_seats, self.length), self.bias).view(q.shape)


@dataclass
class EqualPrompts:
    num: int                           # prompts
    length: int                        # tokens each

    def attend(self, net, layer: int, q, k, v, cache) -> torch.Tensor:
        stored = cache.k[layer].dtype
        if stored != q.dtype:  # k and v as the other paths read them back from the cache
            k, v = k.to(stored).to(q.dtype), v.to(stored).to(q.dtype)
        grid = [t.view(self.num, self.length, -1, net.head_dim).transpose(1, 2) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*grid, is_causal=True, scale=net.attn_scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape)


@dataclass
class Spans:
    spans: torch.Tensor                # [T, 3] each token's (sequence, first key, end key)
    key_rows: torch.Tensor | None = None  # paged: [sequences, KV, L] cache rows of each sequence's keys

    def attend(self, net, layer: int, q, k, v, cache) -> torch.Tensor:
        return net.ops.token_attention(q, cache.k[layer], cache.v[layer], self.spans, self.key_rows, net.attn_scale)


@dataclass
class DecodePart:
    tokens: torch.Tensor               # [Bd] flat indices of the decode tokens
    seats: torch.Tensor | None         # [Bd] their seats (slot cache); None: keys gathered through `keys`
    num_seats: int                     # rows of the decode batch: seats [0, n) of a view, or one per decode
    length: int                        # keys per row
    bias: torch.Tensor | None          # [rows, 1, 1, length] additive
    keys: torch.Tensor | None = None   # paged: [Bd, KV, length] cache rows of each decode's keys


@dataclass
class PromptPart:
    tokens: torch.Tensor               # [Tp] flat indices of the tokens in multi-token chunks
    grid: torch.Tensor                 # [Tp] each one's place in the padded [P * Qmax] query grid
    seats: torch.Tensor | None         # [P] each chunk's seat (slot cache)
    shape: tuple[int, int, int]        # (P chunks, Qmax queries, Lp keys)
    mask: torch.Tensor | None          # [P, 1, Qmax, Lp] bool; None: plain causal from key 0
    keys: torch.Tensor | None = None   # paged: [P, KV, Lp] cache rows of each chunk's keys


@dataclass
class Padded:
    decodes: DecodePart | None
    prompts: PromptPart | None

    def attend(self, net, layer: int, q, k, v, cache) -> torch.Tensor:
        H, D = net.num_heads, net.head_dim
        out = torch.empty_like(q)
        d = self.decodes
        if d is not None and d.keys is not None:  # paged: decode i against its own gathered keys
            out[d.tokens] = decode(net, q[d.tokens], *cache.gather(layer, d.keys), d.bias)
        elif d is not None:
            qd = q.new_zeros(d.num_seats, H, D)
            qd[d.seats] = q[d.tokens]
            out[d.tokens] = decode(net, qd, *cache.view(layer, d.num_seats, d.length), d.bias)[d.seats]
        p = self.prompts
        if p is not None:
            P, Q, L = p.shape
            qp = q.new_zeros(P * Q, H, D)
            qp[p.grid] = q[p.tokens]
            k, v = cache.gather(layer, p.keys) if p.keys is not None else cache.gather(layer, p.seats, L)
            k, v = k.to(q.dtype), v.to(q.dtype)
            o = F.scaled_dot_product_attention(qp.view(P, Q, H, D).transpose(1, 2), k, v, attn_mask=p.mask,
                                               is_causal=p.mask is None, scale=net.attn_scale, enable_gqa=True)
            out[p.tokens] = o.transpose(1, 2).reshape(P * Q, H, D)[p.grid]
        return out


@dataclass
class ByLayer:
    layers: list                       # each layer's path (layers of one window share one)

    def attend(self, net, layer: int, q, k, v, cache) -> torch.Tensor:
        return self.layers[layer].attend(net, layer, q, k, v, cache)


@dataclass
class StepInputs:
    """One step's tensors, shared by every layer."""
    ids: torch.Tensor                  # [T] token ids
    positions: torch.Tensor            # [T] each token's position in its sequence
    places: torch.Tensor               # [T] the seat (slot cache) or block (paged) that holds each token's K/V
    logit_rows: torch.Tensor           # the tokens whose logits are taken
    attention: DenseDecode | EqualPrompts | Spans | Padded | ByLayer
    end: int                           # one past the largest position (known on the host: no read-back)
    pools: dict | None = None          # LayerPools: window -> [T] the block of that window's pool holding each token
