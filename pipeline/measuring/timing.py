"""Timed runs of the engine and of Hugging Face `generate` on the same requests, in one process.

Each case: B prompts arriving at once, exactly `new_tokens` new tokens each (EOS suppressed on both sides).
Hugging Face runs a left-padded batch; the engine runs continuous batching with all B running (its decode steps
compiled when `compile` is set), on the slot cache and again on a paged pool of the same size. Best of `repeats`;
prefill timed within each run (HF: up to its first new tokens; engine: its first, all-prompt step). The floor of a
step is the model's matrix products alone (step_floor_ms, shared with probe_hardware), run right after each engine
run for as many steps as its decode took, so both rates are sustained and timed under the same conditions.
"""
import math
import time

import torch
from transformers.generation.streamers import BaseStreamer

from engine import SamplingParams
from engine.factory import build_engine
from engine.hardware import synchronize
from engine.model.forward import FlatModel
from engine.model.hf import generate_padded
from engine.model.loader import eos_ids, pad_id
from engine.specs import PolicySpec
from engine.usage import PeakRSS
from pipeline.config import kv_spec
from pipeline.measuring.disturbance import ImpossibleFigure, measured
from pipeline.workloads.prompts import prompts_for


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


def bandwidth_gbs(device) -> float:
    """Streaming read: sum of a 512 MiB fp32 tensor, GB/s (the fastest of 5)."""
    x = torch.ones(128 * 2**20, device=device)
    return x.numel() * 4 / best_of(lambda: x.sum(), device) / 1e9


def step_floor_ms(net: FlatModel, batch: int, steps: int = 1, repeats: int = 3, warm: bool = True) -> float:
    """Every matrix of the model once (fused as the engine runs them, plus the LM head) on `batch` rows, ms per
    step: `steps` such steps back to back (a sustained rate, timed like an engine run's decode steps), the fastest
    of `repeats` (after one warm-up unless not `warm`)."""
    mats = net.products
    x = {m.shape[0]: torch.randn(batch, m.shape[0], dtype=m.dtype, device=m.device) for m in mats}

    def run():
        for _ in range(steps):
            for m in mats:
                m(x[m.shape[0]])
    return best_of(run, net.device, repeats, warm) * 1e3 / steps


class FirstToken(BaseStreamer):
    """Notes when generate hands out its first new tokens (its first call carries the prompt)."""

    def __init__(self):
        self.calls, self.at = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self):
        pass


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, float]:
    """(total, prefill) seconds of one left-padded batch generate of exactly new_tokens tokens per row, both from
    the same run (prefill: up to its first new tokens)."""
    first = FirstToken()
    synchronize(model.device)
    t = time.perf_counter()
    generate_padded(model, prompts, new_tokens, pad_id, streamer=first)
    synchronize(model.device)
    end = time.perf_counter()
    return end - t, (first.at or end) - t


def warm_compiled(net: FlatModel, seats: int, graphs: bool = False) -> float:
    """Compile every shape of compiled step up to `seats` rows now (LLMEngine.warm_up), before any timed run; s."""
    return build_engine(net, PolicySpec("continuous", seats), 128, compile=True, graphs=graphs).warm_up()


def engine_run(net: FlatModel, prompts, new_tokens: int, compile: bool = False, kv: str = "slot",
               graphs: bool = False, max_running: int | None = None) -> dict:
    """One engine run of B requests arriving together: total and first-step (prefill) seconds, peak memory (MB),
    KV cache, KV-per-token and weight bytes. kv: the cache (a paged pool gets the slot cache's size)."""
    max_request_tokens = max(map(len, prompts)) + new_tokens
    eng = build_engine(net, PolicySpec("continuous", max_running or len(prompts)), max_request_tokens,
                       eos_ids=eos_ids(net), compile=compile, kv=kv_spec(kv), graphs=graphs)
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
    return {"total": total, "prefill": eng.records[0].duration, "peak_mb": peak, "kv": eng.runner.cache.nbytes,
            "kv_per_token": eng.runner.net.kv_bytes_per_token, "weights": eng.runner.net.nbytes,
            "max_request_tokens": max_request_tokens}


def engine_case(net: FlatModel, prompts, n: int, reps: int, compile: bool = False, graphs: bool = False,
                paged: bool = True) -> dict:
    """The engine's figures for B prompts of exactly n new tokens: the fastest of `reps` runs on the slot cache
    (each followed by as many steps of the matrix products alone: floor_tps, the fastest), and (`paged`) of `reps`
    on a paged pool."""
    B, tokens = len(prompts), len(prompts) * n
    eng, floor = [], []
    for _ in range(reps):
        eng.append(engine_run(net, prompts, n, compile, graphs=graphs))
        floor.append(step_floor_ms(net, B, steps=n - 1, repeats=1, warm=False))
    best = min(eng, key=lambda r: r["total"])
    paged = min((engine_run(net, prompts, n, compile, "paged") for _ in range(reps)), key=lambda r: r["total"]) \
        if paged else None
    row = {"batch": B, "prompt_tokens": sum(map(len, prompts)) // B, "new_tokens": n,
           "engine_tps": tokens / best["total"], "engine_prefill_s": best["prefill"],
           "engine_decode_tps": B * (n - 1) / (best["total"] - best["prefill"]),

           "floor_tps": B / min(floor) * 1e3,  # the matrix products alone, sustained over a decode's steps
           "engine_peak_mb": max(r["peak_mb"] for r in eng),  # host RSS of the process on a CPU, device on a GPU
           "engine_weight_bytes": best["weights"], "kv_cache_bytes": best["kv"], "arithmetic": net.arithmetic,
           "kv_bytes_expected": B * best["max_request_tokens"] * best["kv_per_token"], "compile": compile}
    if paged:  # the same engine on a paged pool of the slot cache's size
        row["paged_decode_tps"] = B * (n - 1) / (paged["total"] - paged["prefill"])
        row["paged_decode_ratio"] = row["paged_decode_tps"] / row["engine_decode_tps"]
    row["floor_fraction"] = row["engine_decode_tps"] / row["floor_tps"]
    return row


def hf_case(model, prompts, n: int, reps: int, pad_id: int) -> dict:
    """Hugging Face generate's figures for the same prompts: the fastest of `reps` left-padded batch runs."""
    total, prefill = min(hf_generate(model, prompts, n, pad_id) for _ in range(reps))
    B = len(prompts)
    return {"hf_tps": B * n / total, "hf_prefill_s": prefill, "hf_decode_tps": B * (n - 1) / (total - prefill)}


def check_case(row: dict) -> None:
    """Raise ImpossibleFigure for a rate that is not finite and positive, or a prefill that outlasts its whole
    request."""
    for k in ("engine_tps", "hf_tps", "engine_decode_tps", "paged_decode_tps", "hf_decode_tps", "floor_tps"):
        if k in row and not (math.isfinite(row[k]) and row[k] > 0):
            raise ImpossibleFigure(f"B={row['batch']}: {k} = {row[k]}")
    for side in ("engine", "hf"):
        if f"{side}_tps" in row and row[f"{side}_prefill_s"] >= row["batch"] * row["new_tokens"] / row[f"{side}_tps"]:
            raise ImpossibleFigure(f"B={row['batch']}: {side}_prefill_s = {row[f'{side}_prefill_s']} outlasts the "
                                   "whole request")


def engine_speed(levels: dict, tokenizer, bench, limits, probe_gbs: float | None = None) -> list[dict]:
    """Every case of bench.engine_speed (a conf/bench section) at every level after one unreported warm-up, each
    measured again while disturbed (limits: the config's `measure`). levels: name -> (the engine's FlatModel, the
    Hugging Face model it is compared against, the level's conf/precision entry); generate runs once per case for
    each distinct model. Each row's decode rate is set against the floor for its batch (floor_tps: its matrix
    products alone, sustained after each engine run) and, given the probe's read bandwidth, against the bytes
    floor (bytes_floor_tps: every weight byte read once a step at that bandwidth, the bound of small batches); the
    same read measured again in this process before each case gives bytes_fraction_here (a machine whose memory
    reads differently from run to run shows it here)."""
    pad = pad_id(tokenizer)
    flags = {name: (bool(bench.compile or pc.compile), bool(pc.graphs)) for name, (_, _, pc) in levels.items()}
    net0, model0, _ = next(iter(levels.values()))
    device, vocab = net0.device, model0.config.vocab_size
    warm = prompts_for("chat", 2, tokenizer, vocab)
    warmed = set()  # ids of the generate models warmed up: each distinct one once
    for name, (net, model, _) in levels.items():
        engine_run(net, warm, 8, flags[name][0], graphs=flags[name][1])
        if id(model) not in warmed:
            hf_generate(model, warm, 8, pad)
            warmed.add(id(model))
        if flags[name][0]:
            warm_compiled(net, max(int(case["batch"]) for case in bench.cases), flags[name][1])
    rows, first = [], next(iter(levels))  # the configured level: also measured on a paged pool
    for case in bench.cases:
        B, n, reps = int(case["batch"]), int(case["new_tokens"]), int(case.get("repeats", bench.repeats))
        prompts = prompts_for(case["prompt"], B, tokenizer, vocab)
        here, hf = bandwidth_gbs(device), {}  # GB/s, read just before the case in this process
        for level, (net, model, _) in levels.items():
            row, watch = measured(lambda: engine_case(net, prompts, n, reps, *flags[level], paged=level == first),
                                  limits, f"engine_speed {level} B={B}", check=check_case)
            if id(model) not in hf:
                hf[id(model)] = measured(lambda: {"batch": B, "new_tokens": n, **hf_case(model, prompts, n, reps,
                                                                                        pad)},
                                         limits, f"engine_speed generate B={B}", check=check_case)
            ref, ref_watch = hf[id(model)]
            row = {"precision": level, "prompt": case["prompt"], **row,
                   **{k: v for k, v in ref.items() if k.startswith("hf_")},
                   **watch.fields(), "hf_disturbed": ref_watch.disturbed, "hf_dtype": str(model.dtype)}
            row["ratio"] = row["engine_tps"] / row["hf_tps"]
            row["decode_ratio"] = row["engine_decode_tps"] / row["hf_decode_tps"]
            if probe_gbs:
                row["bytes_floor_tps"] = B * probe_gbs * 1e9 / net.step_bytes
                row["bytes_fraction"] = row["engine_decode_tps"] / row["bytes_floor_tps"]
            row["bandwidth_gbs_here"] = here
            row["bytes_fraction_here"] = row["engine_decode_tps"] * net.step_bytes / (B * here * 1e9)
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows
