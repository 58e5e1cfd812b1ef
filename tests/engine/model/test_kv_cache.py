"""The slot cache holds exactly seats x max_request_tokens x per-token KV bytes and never grows; the cat cache does."""
import torch

from engine import SamplingParams
from engine.factory import build_engine
from engine.model.kv_cache import CatCache, SlotCache
from engine.specs import PolicySpec
from pipeline.config import kv_spec


def test_slot_cache_size_is_exact_and_fixed(tiny_llama):
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 3), max_request_tokens=96)
    # tiny-llama: K and V x 2 layers x 2 KV heads x head_dim 16 x 4 bytes (fp32) = 512 bytes per token
    assert eng.runner.net.kv_bytes_per_token == 512
    expected = 3 * 96 * 512  # seats x max_request_tokens x bytes per token = 147,456 bytes
    assert eng.runner.cache.nbytes == expected
    ptrs = [t.data_ptr() for t in eng.runner.cache.k]
    eng.generate([[5] * 10, [6] * 30], SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert eng.runner.cache.nbytes == expected and [t.data_ptr() for t in eng.runner.cache.k] == ptrs


def test_write_lands_in_place():
    c = SlotCache(num_layers=1, num_seats=2, seat_len=8, num_kv_heads=2, head_dim=4)
    k = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4)
    slots = c.rows(torch.tensor([1, 0]), torch.tensor([5, 2]))
    c.write(0, slots, k, -k)
    assert torch.equal(c.k[0][1, :, 5], k[0]) and torch.equal(c.v[0][0, :, 2], -k[1])
    assert c.k[0].abs().sum() == k.abs().sum()


def test_cat_cache_grows_and_gives_the_same_tokens(tiny_llama):
    prompts, p = [[5] * 10, [6] * 17], SamplingParams(max_new_tokens=20, ignore_eos=True)
    slot = build_engine(tiny_llama, PolicySpec.of("continuous", 2), 64).generate(prompts, p)
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 2), 64, kv=kv_spec("cat"))
    assert isinstance(eng.runner.cache, CatCache) and eng.runner.cache.nbytes == 0
    assert eng.generate(prompts, p) == slot
    # the last token is never fed back
    assert eng.runner.cache.copied_bytes > 0 and eng.runner.cache.k[0].shape[2] == 17 + 20 - 1
