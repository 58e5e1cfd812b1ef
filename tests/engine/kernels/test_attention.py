"""Attention's fused kernels (engine/kernels/csrc/attention.h; decode_attention.cpp, token_attention.cpp): each
equals softmax attention over the keys it reads, masked or uncovered keys (NaN) are never read, the fused decode
gives the bits of rotary, K/V writes and attention one after another, and a bf16 cache (K and V rounded to nearest
even when written) is read as its fp32 values."""
import pytest
import torch

from engine.kernels import build as native

lab = native.ops()
needs_lab = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")


def reference_attention(q, k, v, bias, scale):
    S, KV, L, D = k.shape
    scores = torch.einsum("skgd,skld->skgl", q.view(S, KV, -1, D), k) * scale
    if bias is not None:
        scores = scores + bias[:, None, None, :]
    return torch.einsum("skgl,skld->skgd", scores.softmax(-1), v).reshape(q.shape)


@needs_lab
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (4, 4, 16), (14, 2, 64), (8, 1, 128), (6, 2, 20)])
@pytest.mark.parametrize("masked", [None, "tail", "window"])
def test_decode_attention_equals_softmax_attention(heads, kv, d, masked):
    """GQA groups of 1 to 8 query heads (remainders past 4), head dims that are and are not whole vectors, keys a
    strided view of a larger cache; masked keys (each sequence's tail, or all but a sliding window of 6, so blocks
    of keys mix masked and read ones) hold NaN, which must never be read."""
    g = torch.Generator().manual_seed(heads * d)
    S, L, cap = 5, 37, 50
    cache_k, cache_v = torch.randn(S + 2, kv, cap, d, generator=g), torch.randn(S + 2, kv, cap, d, generator=g)
    k, v = cache_k[:S, :, :L], cache_v[:S, :, :L]
    q = torch.randn(S, heads, d, generator=g)
    bias = None
    if masked:
        lens, j = torch.tensor([1, 9, 17, 36, 37])[:, None], torch.arange(L)[None]
        out = (j >= lens) | (j < lens - 6) if masked == "window" else j >= lens
        bias = torch.zeros(S, L).masked_fill_(out, -torch.inf)
        want = reference_attention(q, k, v, bias, 0.125)
        cache_k[:S, :, :L][bias.isinf()[:, None, :].expand(S, kv, L)] = torch.nan
        cache_v[:S, :, :L][bias.isinf()[:, None, :].expand(S, kv, L)] = torch.nan
    else:
        want = reference_attention(q, k, v, bias, 0.125)
    torch.testing.assert_close(lab.decode_attention(q, k, v, bias, 0.125), want)


@needs_lab
def test_a_zero_bias_reads_as_none_and_far_scores_weigh_nothing():
    """A bias of zeros (the tail mask of a batch whose sequences are all as long) gives the very bits of no bias;
    keys scored far below the best (exp arguments down to -400, past -104 where the softmax's exp gives 0) weigh
    nothing and the rest weigh as in fp64 within a few ulp (scores exact: -l / 2 for keys l < 20, -200 - l past them;
    value l the l-th unit vector, so the output is the weights)."""
    g = torch.Generator().manual_seed(7)
    S, KV, H, L, D = 3, 2, 6, 41, 64
    q, k, v = (torch.randn(S, n, *rest, D, generator=g) for n, rest in ((H, ()), (KV, (L,)), (KV, (L,))))
    assert torch.equal(lab.decode_attention(q, k, v, torch.zeros(S, L), 0.125),
                       lab.decode_attention(q, k, v, None, 0.125))
    q, k, v = torch.zeros(S, H, D), torch.zeros(S, KV, L, D), torch.eye(L, D).expand(S, KV, L, D)
    j = torch.arange(L, dtype=torch.float32)
    q[..., 0], k[..., 0] = 1.0, torch.where(j < 20, -j / 2, -200 - j)
    weights = lab.decode_attention(q, k, v, None, 1.0)[..., :L]  # value l is the l-th unit vector
    want = torch.softmax(torch.where(j < 20, -j / 2, -200 - j).double(), 0)
    assert (weights[..., 20:] == 0).all()
    assert ((weights[..., :20] - want[:20]).abs() / want[:20]).max() < 4e-7  # a few ulp


@needs_lab
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (6, 2, 20)])
def test_rotary_decode_attention_is_rotary_then_writes_then_decode_attention(dtype, heads, kv, d):
    """The fused decode (each group rotates its rows and writes its K and V, then attends) gives the bits of
    rotary_, write_rows_ and decode_attention one after another: the same output and cache, qkv left as it was;
    ragged positions (a bias), more seats than decodes, strided rows; a row outside its own seat and head (where
    another group reads) is refused."""
    g = torch.Generator().manual_seed(heads + d)
    S, seats, cap = 5, 7, 40
    qkv = torch.randn(S, (heads + 2 * kv) * d + 3, generator=g)[:, 3:]  # strided rows, as the product's views
    qk, v = qkv[:, :(heads + kv) * d].view(S, heads + kv, d), qkv[:, (heads + kv) * d:].view(S, kv, d)
    cos, sin = torch.randn(S, d, generator=g), torch.randn(S, d, generator=g)
    pos = torch.tensor([3, 11, 0, 25, 17])
    length = int(pos.max()) + 1
    rows = ((torch.arange(S)[:, None] * kv + torch.arange(kv)[None]) * cap + pos[:, None]).reshape(-1)
    bias = torch.zeros(S, length).masked_fill_(torch.arange(length)[None] > pos[:, None], -torch.inf)
    caches = [torch.randn(seats, kv, cap, d, generator=g).to(dtype) for _ in range(2)]
    k1, v1 = (c.clone() for c in caches)
    x = qk.clone()
    lab.rotary_(x, cos, sin)
    lab.write_rows_(k1.view(-1, d), rows, x[:, heads:])
    lab.write_rows_(v1.view(-1, d), rows, v)
    want = lab.decode_attention(x[:, :heads], k1[:S, :, :length], v1[:S, :, :length], bias, 0.125)
    before = qkv.clone()
    k2, v2 = (c.clone() for c in caches)
    got = lab.rotary_decode_attention(qkv, cos, sin, k2, v2, rows, bias, length, heads, 0.125)
    assert torch.equal(got, want) and torch.equal(k2, k1) and torch.equal(v2, v1) and torch.equal(qkv, before)
    assert not torch.equal(k2, caches[0])  # the writes happened
    for wrong in (rows + seats * kv * cap, rows.roll(1)):  # beyond the cache; in another group's seat or head
        with pytest.raises(RuntimeError, match="outside its own seat"):
            lab.rotary_decode_attention(qkv, cos, sin, k2, v2, wrong, bias, length, heads, 0.125)


def each_token_alone(q, k, v, spans, scale):
    """Reference: token t's query heads against keys [first, end) of its sequence, k and v [S, KV, L, D]."""
    return torch.cat([reference_attention(q[t:t + 1], k[s:s + 1, :, a:b], v[s:s + 1, :, a:b], None, scale)
                      for t, (s, a, b) in enumerate(spans.tolist())])


def unread_poisoned(cache, spans):
    """NaN in every key and value of `cache` [S, KV, L, D] that no span covers."""
    covered = torch.zeros(cache.shape[0], cache.shape[2], dtype=torch.bool)
    for s, a, b in spans.tolist():
        covered[s, a:b] = True
    cache.masked_fill_(~covered[:, None, :, None], torch.nan)


@needs_lab
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (14, 2, 64), (6, 2, 20)])
def test_token_attention_reads_each_tokens_own_keys_in_a_slot_cache(heads, kv, d):
    """Ragged prompts, a chunk after a cached prefix, a sliding window's span and lone decodes in scattered seats,
    in one call; q a strided view as the fused projection gives it; keys no span covers hold NaN, never read."""
    g = torch.Generator().manual_seed(heads + d)
    S, cap = 6, 40
    k, v = torch.randn(S, kv, cap, d, generator=g), torch.randn(S, kv, cap, d, generator=g)
    spans = [(4, 0, p + 1) for p in range(7)]            # a whole prompt of 7 in seat 4
    spans += [(1, 0, p + 1) for p in range(20, 33)]      # a chunk of 13 after a 20-token prefix in seat 1
    spans += [(0, max(0, p - 5), p + 1) for p in range(9, 12)]  # a window of 6 keys in seat 0
    spans += [(5, 0, 39), (2, 0, 1)]                     # decodes
    spans = torch.tensor(spans)
    q = torch.randn(len(spans), heads + 2 * kv, d, generator=g)[:, :heads]
    want = each_token_alone(q, k, v, spans, 0.125)
    unread_poisoned(k, spans)
    unread_poisoned(v, spans)
    torch.testing.assert_close(lab.token_attention(q, k, v, spans, None, 0.125), want)


@needs_lab
def test_token_attention_reads_a_paged_cache_through_its_rows():
    """Through each sequence's block rows (blocks in no order): the same as attention over the gathered keys; rows
    no span covers hold NaN, unread."""
    from engine.model.kv_cache import PagedCache

    g = torch.Generator().manual_seed(0)
    cache = PagedCache(1, 12, 4, 2, 16)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    rows = cache.keys(torch.tensor([[3, 7, 1], [10, 0, 5]]))  # 12 positions each
    spans = torch.tensor([(1, 0, 9), (1, 0, 10), (0, 0, 12), (0, 2, 5)])
    k, v = cache.gather(0, rows)
    q = torch.randn(4, 6, 16, generator=g)
    want = each_token_alone(q, k, v, spans, 0.25)
    unread_poisoned(k, spans)
    unread_poisoned(v, spans)
    for store, keys in ((cache.k[0], k), (cache.v[0], v)):  # blocks in no table, and unread rows, all NaN
        store.fill_(torch.nan).view(-1, 16)[rows.view(-1)] = keys.reshape(-1, 16)
    torch.testing.assert_close(lab.token_attention(q, cache.k[0], cache.v[0], spans, rows, 0.25), want)


@needs_lab
@pytest.mark.parametrize("D", [64, 16, 24])  # whole vectors, one vector, and the any-head-dim path
def test_attention_reads_a_bf16_cache_as_its_fp32_values(D):
    """The same sums of the same products as over an fp32 cache holding those values: the very bits where rows are
    read in order, within fp32 rounding where a bf16 row is read evens and odds apart (AVX-512, whole pairs of
    vectors: the scores add in another order; a value misread is off by its own size); one key alone gives its value
    row exactly."""
    g = torch.Generator().manual_seed(D)
    S, H, KV, L = 5, 6, 2, 37
    q = torch.randn(S, H, D, generator=g)
    k, v = (torch.randn(S, KV, L, D, generator=g).bfloat16() for _ in range(2))
    bias = torch.zeros(S, L)
    bias[1, 3], bias[2, 10:] = -torch.inf, -torch.inf
    split = D % 32 == 0 and native.capabilities()["isa"] == "AVX512"  # rows read evens and odds apart

    def same(a, b):  # read in order: the very bits; split: fp32 sums in another order
        if split:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(a, b)

    got = lab.decode_attention(q, k, v, bias, 0.3)
    same(got, lab.decode_attention(q, k.float(), v.float(), bias, 0.3))
    one = lab.decode_attention(q, k[:, :, :1], v[:, :, :1], None, 0.3)
    assert torch.equal(one, v[:, :, :1].float().repeat_interleave(H // KV, dim=1).squeeze(2))
    spans = torch.tensor([[0, 0, 5], [1, 2, 30], [4, 0, 37]])
    got = lab.token_attention(q[:3], k, v, spans, None, 0.3)
    same(got, lab.token_attention(q[:3], k.float(), v.float(), spans, None, 0.3))


@needs_lab
def test_writes_round_to_nearest_even_and_dtypes_are_checked():
    src = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)) * 1e3
    dst = torch.zeros(10, 64, dtype=torch.bfloat16)
    rows = torch.tensor([9, 0, 4, 2, 3, 7])
    lab.write_rows_(dst, rows, src)
    assert torch.equal(dst[rows], src.reshape(6, 64).bfloat16())
    assert not dst[[1, 5, 6, 8]].any()
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match="k and v of one dtype"):
        lab.decode_attention(q, k.bfloat16(), k, None, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        lab.decode_attention(q, k.half(), k.half(), None, 1.0)
