"""Seed 003 §3: the growing torch.cat cache against the slot cache, batch 16.

For each context: the time to append one token's K/V for the whole batch in every layer, the bytes a cat copies
(computed: 2 x layers x batch x (context + 1) x kv width x bytes), and a full decode step, for both caches.
"""
import time

import torch

from engine import SamplingParams
from engine.factory import build_engine
from engine.hardware import synchronize
from engine.specs import PolicySpec
from pipeline.config import kv_spec

BATCH, CONTEXTS, STEPS = 16, [32, 128, 248], 5


def measure(net, cache: str, context: int) -> dict:
    eng = build_engine(net, PolicySpec("continuous", BATCH), context + STEPS + 2, kv=kv_spec(cache))
    p = SamplingParams(max_new_tokens=STEPS + 1, ignore_eos=True)
    for i in range(BATCH):
        eng.add_request(str(i), [3 + (i * 7 + j) % 200 for j in range(context)], p)
    eng.step()  # prefill to `context`
    while eng.has_work():
        eng.step()
    decode = sorted(r.duration for r in eng.records[1:])
    c = eng.runner.cache
    before = getattr(c, "copied_bytes", 0)
    append = append_s(c, eng.runner.net, context + STEPS + 1)
    return {"append_ms": append * 1e3, "decode_step_ms": decode[len(decode) // 2] * 1e3,
            "copied_mb_measured": (getattr(c, "copied_bytes", 0) - before) / 1e6}


def append_s(cache, net, position: int) -> float:
    """Seconds to write one more token's K/V for each of the BATCH requests in every layer (the append alone)."""
    dev = cache.k[0].device
    seats = torch.arange(BATCH, device=dev)
    pos = torch.full((BATCH,), position, device=dev)
    k = torch.randn(BATCH, net.num_kv_heads, net.head_dim, dtype=net.dtype, device=dev)
    synchronize(dev)
    t = time.perf_counter()
    for layer in range(net.num_layers):
        cache.write(layer, cache.rows(seats, pos), k, k)
    synchronize(dev)
    return time.perf_counter() - t


def compare(net) -> list[dict]:
    """Per context: both caches' append and decode step times, and the bytes a cat copies (computed and counted)."""
    rows = []
    for ctx in CONTEXTS:
        cat, slot = measure(net, "cat", ctx), measure(net, "slot", ctx)
        rows.append({"context": ctx, "cat_append_ms": cat["append_ms"], "slot_append_ms": slot["append_ms"],
                     "cat_copied_mb": net.kv_bytes_per_token * BATCH * (ctx + 1) / 1e6,
                     "cat_copied_mb_measured": cat["copied_mb_measured"],
                     "cat_decode_ms": cat["decode_step_ms"], "slot_decode_ms": slot["decode_step_ms"]})
        print(rows[-1], flush=True)
    return rows
