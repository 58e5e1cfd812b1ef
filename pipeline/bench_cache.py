"""Stage bench_cache: seed 003 §3, the growing torch.cat cache against the slot cache, batch 16.

For each context: the time to append one token's K/V for the whole batch in every layer, the bytes a cat copies
(computed: 2 x layers x batch x (context + 1) x kv width x bytes), and a full decode step, for both engines.
"""
import time

import torch

from engine import LLMEngine, SamplingParams
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.io import write_json

BATCH, CONTEXTS, STEPS = 16, [32, 128, 248], 5


def measure(model, cache: str, context: int) -> dict:
    eng = LLMEngine(model, {"name": "continuous", "max_seats": BATCH}, context + STEPS + 2, cache=cache)
    p = SamplingParams(max_new_tokens=STEPS + 1, ignore_eos=True)
    for i in range(BATCH):
        eng.add_request(str(i), [3 + (i * 7 + j) % 200 for j in range(context)], p)
    eng.step()  # prefill to `context`
    while eng.has_work():
        eng.step()
    decode = sorted(s["duration"] for s in eng.steps[1:])
    c, net = eng.runner.cache, eng.runner.net
    seats = torch.arange(BATCH)
    pos = torch.full((BATCH,), context + STEPS + 1)
    k = torch.randn(BATCH, net.num_kv_heads, net.head_dim, dtype=net.dtype)
    before = getattr(c, "copied_bytes", 0)
    t = time.perf_counter()
    for layer in range(net.num_layers):  # one more token for everyone: the append alone
        c.write(layer, c.slots(seats, pos), k, k)
    append = time.perf_counter() - t
    return {"append_ms": append * 1e3, "decode_step_ms": decode[len(decode) // 2] * 1e3,
            "copied_mb_measured": (getattr(c, "copied_bytes", 0) - before) / 1e6}


def main(cfg) -> list[dict]:
    model, _ = load_configured_model(cfg)
    net_kv = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads)
    rows = []
    for ctx in CONTEXTS:
        cat, slot = measure(model, "cat", ctx), measure(model, "slot", ctx)
        rows.append({"context": ctx, "cat_append_ms": cat["append_ms"], "slot_append_ms": slot["append_ms"],
                     "cat_copied_mb": net_kv * BATCH * (ctx + 1) * model.dtype.itemsize / 1e6,
                     "cat_copied_mb_measured": cat["copied_mb_measured"],
                     "cat_decode_ms": cat["decode_step_ms"], "slot_decode_ms": slot["decode_step_ms"]})
        print(rows[-1], flush=True)
    write_json(ROOT / "data" / "results" / "cache.json", {"batch": BATCH, "rows": rows,
                                                          "environment": environment(cfg.precision.device)})
    return rows


if __name__ == "__main__":
    main(load())
