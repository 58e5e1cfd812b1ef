"""Paged KV per layer type without a model: a pool per window (LayerPools) admits, grows, slides and frees together,
and a memory budget seats as many more requests as the windowed layers' smaller blocks allow."""
from dataclasses import replace

import pytest

from engine.core.kv_blocks import NULL_BLOCK, BlockManager
from engine.core.kv_pools import LayerPools, make_pools
from pipeline.config import kv_spec


def span(seq):
    return lambda a, b: seq[a:b]


GEMMA_LAYERS = [512] * 5 + [None]  # Gemma 3's pattern: five windowed layers (512 tokens), then a full one
KV = kv_spec("paged", block_size=16, num_blocks=None, memory_mb=None, watermark=0.01, prefix_caching=True)


@pytest.mark.parametrize("context", [2048, 8192])
def test_a_memory_budget_seats_more_requests_where_windowed_layers_keep_their_window(context):
    """A 1 GiB budget: windowed layers keep 33 blocks of 16 (the next token's window: 512 positions over at most 33),
    full ones the context, so 6 x context / (context + 5 x 528) times more requests fit, less one prompt's blocks
    kept free in the windowed pool (prefilled whole): within 5 %."""
    per_token = 6 * 1024  # 1 KiB per layer and token
    full = BlockManager.sized(replace(KV, memory_mb=1024), 1, context, per_token)
    pools = make_pools(replace(KV, memory_mb=1024), 1, context, per_token, GEMMA_LAYERS)
    assert isinstance(pools, LayerPools) and set(pools.pools) == {512, None}
    seats_full = full.num_blocks / (context // 16)
    seats = pools.pools[None].num_blocks / (context // 16)
    expected = 6 * context / (context + 5 * 33 * 16)
    assert 0.95 * expected <= seats / seats_full <= expected
    bytes_held = sum(GEMMA_LAYERS.count(w) * p.num_blocks * 16 * 1024 for w, p in pools.pools.items())
    assert 0.99 * 2**30 <= bytes_held <= 2**30  # the budget spent, not exceeded


def test_layer_pools_admit_grow_slide_and_free_together():
    """Two pools, a window of 6 positions in blocks of 4: a request's windowed table releases what its window left,
    the full table keeps everything; a prefix hit is what both pools hold; a pool without room fails growth for
    both, changing nothing."""
    pools = LayerPools({6: BlockManager(12, 4, 0, True, window=6), None: BlockManager(12, 4, 0, True)},
                       [6, None, 6])
    assert pools.layer_blocks() == [12, 12, 12]
    seq = list(range(20, 40))
    assert pools.allocate("a", 12, span(seq)) == 0
    pools.cache("a", 12, span(seq))
    pools.slide("a", 12)  # the next token at 12 attends 7..12: block 0 (0-3) is out
    assert pools.tables("a")[6][0] == NULL_BLOCK
    assert pools.pools[6].num_used == 2 and pools.pools[None].num_used == 3
    assert pools.grow("a", 13) and pools.pools[6].num_used == 3 and pools.pools[None].num_used == 4
    # b shares a's first 8 tokens: the full pool holds blocks 0 and 1, the windowed pool block 1 only (block 0 left
    # its window and, freed with its registration, still rests in the free queue): the hit is both blocks
    assert pools.allocate("b", 9, span(seq)) == 8
    pools.check()
    pools.free("a")
    pools.free("b")
    pools.check()
    assert pools.pools[6].num_free == 11 and pools.pools[None].num_free == 12
    tight = LayerPools({6: BlockManager(4, 4, 0, True, window=6), None: BlockManager(12, 4, 0, True)}, [6, None])
    tight.allocate("c", 12, span(seq))
    assert not tight.grow("c", 13) and len(tight.pools[None].table("c")) == 3  # the windowed pool is full
    tight.check()
