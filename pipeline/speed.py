"""Timed runs of the engine and of Hugging Face `generate` on the same requests, in one process.

Each case: B prompts arriving at once, exactly `new_tokens` new tokens each (EOS ignored / suppressed).
Hugging Face runs a left-padded batch; the engine runs continuous batching with B seats (its decode steps compiled
when `compile` is set), on the slot cache and again on a paged pool of the same size. Best of `repeats`; prefill
timed apart (HF: a 1-token generate; engine: its first, all-prompt step). Also the floor of a step: the model's
matrix products alone (step_floor_ms, shared with probe_hardware), run right after each engine run for as many steps
as its decode took, so both rates are sustained ones timed under the same conditions.
"""
import time

import torch

from engine import LLMEngine, SamplingParams
from engine.hf import generate_padded
from engine.model import FlatModel
from pipeline.env import PeakRSS, synchronize
from pipeline.prompts import prompts_for


def best_of(fn, device, repeats: int = 5, warm: bool = True) -> float:
    """Fastest of `repeats` timed calls (s) after one warm-up call (unless not `warm`), the device synchronised
    around each."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def step_floor_ms(net: FlatModel, batch: int, steps: int = 1, repeats: int = 3, warm: bool = True) -> float:
    """Every matrix of the model once (fused as the engine runs them, plus the LM head) on `batch` rows, ms per
    step: `steps` such steps back to back (a sustained rate, timed like an engine run's decode steps), the fastest
    of `repeats` (after one warm-up unless not `warm`)."""
    mats = [w for layer in net.layers for w in (layer[1], layer[2], layer[4], layer[5])] + [net.lm_head]
    x = {m.shape[0]: torch.randn(batch, m.shape[0], dtype=m.dtype, device=m.device) for m in mats}

    def run():
        for _ in range(steps):
            for m in mats:
                m(x[m.shape[0]])
    return best_of(run, net.embed.device, repeats, warm) * 1e3 / steps


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for one left-padded batch generate of exactly new_tokens tokens per row."""
    synchronize(model.device)
    t = time.perf_counter()
    generate_padded(model, prompts, new_tokens, pad_id)
    synchronize(model.device)
    return time.perf_counter() - t


def warm_compiled(model, seats: int, eos, graphs: bool = False) -> float:
    """Compile every kind of compiled step up to `seats` rows now (LLMEngine.warm_up), before any timed run; s."""
    return LLMEngine(model, {"name": "continuous", "max_seats": seats}, 128, eos, compile=True, graphs=graphs).warm_up()


def engine_run(model, prompts, new_tokens: int, eos, compile: bool = False, kv: str = "slot",
               graphs: bool = False) -> dict:
    """One engine run of B requests arriving together; total and first-step (prefill) seconds, cache size. kv: the
    cache (a paged pool gets the slot cache's size: memory is plentiful)."""
    seat_tokens = max(map(len, prompts)) + new_tokens
    eng = LLMEngine(model, {"name": "continuous", "max_seats": len(prompts)}, seat_tokens, eos, compile=compile, kv=kv,
                    graphs=graphs)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    device = eng.runner.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as rss:
        synchronize(device)
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        while eng.has_work():
            eng.step()
        synchronize(device)
        total = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(device) / 1e6 if device.type == "cuda" else rss.peak_mb
    return {"total": total, "prefill": eng.steps[0]["duration"], "peak_mb": peak, "kv": eng.runner.cache.nbytes,
            "kv_per_token": eng.runner.net.kv_bytes_per_token, "weights": eng.runner.net.nbytes,
            "seat_tokens": seat_tokens}


def run_case(model, tokenizer, case: dict, repeats: int, eos, pad_id: int, compile: bool = False,
             graphs: bool = False) -> dict:
    B, n = int(case["batch"]), int(case["new_tokens"])
    prompts = prompts_for(case["prompt"], B, tokenizer, model.config.vocab_size)
    reps = int(case.get("repeats", repeats))
    net, eng, floor = FlatModel.of(model), [], []
    for _ in range(reps):  # each run's decode steps, then as many steps of the matrix products alone
        eng.append(engine_run(model, prompts, n, eos, compile, graphs=graphs))
        floor.append(step_floor_ms(net, B, steps=n - 1, repeats=1, warm=False))
    best = min(eng, key=lambda r: r["total"])
    paged = min((engine_run(model, prompts, n, eos, compile, "paged") for _ in range(reps)), key=lambda r: r["total"])
    hf_total = min(hf_generate(model, prompts, n, pad_id) for _ in range(reps))
    hf_prefill = min(hf_generate(model, prompts, 1, pad_id) for _ in range(reps))
    tokens = B * n
    row = {"batch": B, "prompt_tokens": sum(map(len, prompts)) // B, "new_tokens": n,
           "engine_tps": tokens / best["total"], "hf_tps": tokens / hf_total,
           "engine_prefill_s": best["prefill"], "hf_prefill_s": hf_prefill,
           "engine_decode_tps": B * (n - 1) / (best["total"] - best["prefill"]),
           "paged_decode_tps": B * (n - 1) / (paged["total"] - paged["prefill"]),  # the same engine on paged KV
           "hf_decode_tps": B * (n - 1) / (hf_total - hf_prefill),
           "floor_tps": B / min(floor) * 1e3,  # the matrix products alone, sustained over a decode's steps
           "engine_peak_mb": max(r["peak_mb"] for r in eng),  # host RSS of the process on a CPU, device on a GPU
           "engine_weight_bytes": best["weights"], "kv_cache_bytes": best["kv"],
           "kv_bytes_expected": B * best["seat_tokens"] * best["kv_per_token"], "compile": compile}
    row["ratio"] = row["engine_tps"] / row["hf_tps"]
    row["decode_ratio"] = row["engine_decode_tps"] / row["hf_decode_tps"]
    row["paged_decode_ratio"] = row["paged_decode_tps"] / row["engine_decode_tps"]  # paged against slot
    row["floor_fraction"] = row["engine_decode_tps"] / row["floor_tps"]
    return row
