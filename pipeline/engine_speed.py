"""Speed benchmark: the engine against Hugging Face `generate` on the same model, dtype and requests, one process.

Each case: B prompts arriving at once, exactly `new_tokens` new tokens each (EOS ignored / suppressed).
Hugging Face runs a left-padded batch; the engine runs continuous batching with B seats (its decode steps compiled
when `compile` is set). Best of `repeats` after one warm-up; prefill timed apart (HF: a 1-token generate; engine:
its first, all-prompt step).
Writes reports/engine_speed.json (a list of rows) and prints them.
"""
import json
import time

import torch

from engine import LLMEngine, SamplingParams
from engine.hf import generate_padded
from engine.loader import eos_ids
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import PeakRSS, environment
from pipeline.io import write_json
from pipeline.prompts import prompts_for


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for one left-padded batch generate of exactly new_tokens tokens per row."""
    t = time.perf_counter()
    generate_padded(model, prompts, new_tokens, pad_id)
    return time.perf_counter() - t


def engine_run(model, prompts, new_tokens: int, eos, compile: bool = False) -> dict:
    """One engine run of B requests arriving together; total and first-step (prefill) seconds, cache size."""
    seat_tokens = max(map(len, prompts)) + new_tokens
    eng = LLMEngine(model, {"name": "continuous", "max_seats": len(prompts)}, seat_tokens, eos, compile=compile)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with PeakRSS() as rss:
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        while eng.has_work():
            eng.step()
        total = time.perf_counter() - t
    return {"total": total, "prefill": eng.steps[0]["duration"], "rss": rss.peak_mb,
            "kv": eng.runner.cache.nbytes, "kv_per_token": eng.runner.net.kv_bytes_per_token, "seat_tokens": seat_tokens}


def run_case(model, tokenizer, case: dict, repeats: int, eos, pad_id: int, compile: bool = False) -> dict:
    B, n = int(case["batch"]), int(case["new_tokens"])
    prompts = prompts_for(case["prompt"], B, tokenizer, model.config.vocab_size)
    reps = int(case.get("repeats", repeats))
    eng = [engine_run(model, prompts, n, eos, compile) for _ in range(reps)]
    best = min(eng, key=lambda r: r["total"])
    hf_total = min(hf_generate(model, prompts, n, pad_id) for _ in range(reps))
    hf_prefill = min(hf_generate(model, prompts, 1, pad_id) for _ in range(reps))
    tokens = B * n
    row = {"batch": B, "prompt_tokens": sum(map(len, prompts)) // B, "new_tokens": n,
           "engine_tps": tokens / best["total"], "hf_tps": tokens / hf_total,
           "engine_prefill_s": best["prefill"], "hf_prefill_s": hf_prefill,
           "engine_decode_tps": B * (n - 1) / (best["total"] - best["prefill"]),
           "hf_decode_tps": B * (n - 1) / (hf_total - hf_prefill),
           "engine_peak_rss_mb": max(r["rss"] for r in eng), "kv_cache_bytes": best["kv"],
           "kv_bytes_expected": B * best["seat_tokens"] * best["kv_per_token"], "compile": compile}
    row["ratio"] = row["engine_tps"] / row["hf_tps"]
    row["decode_ratio"] = row["engine_decode_tps"] / row["hf_decode_tps"]
    return row


def main(cfg) -> list[dict]:
    torch.manual_seed(int(cfg.seed))
    model, tokenizer = load_configured_model(cfg)
    eos = eos_ids(model)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    bench = cfg.bench.engine_speed
    compile = bool(bench.compile)
    warm = prompts_for("chat", 2, tokenizer, model.config.vocab_size)
    # warm-up, not reported; with compile: the graphs of one row, of several rows, of several rows of one length
    for prompts in (warm[:1], warm, [warm[0]] * 2) if compile else (warm,):
        engine_run(model, prompts, 8, eos, compile)
    hf_generate(model, warm, 8, pad_id)
    rows, env = [], environment(cfg.precision.device)
    for case in bench.cases:
        row = run_case(model, tokenizer, dict(case), int(bench.repeats), eos, pad_id, compile)
        row.update(model=cfg.model.name, dtype=cfg.precision.dtype, **env)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    write_json(ROOT / "reports" / "engine_speed.json", rows)
    return rows


if __name__ == "__main__":
    main(load())
