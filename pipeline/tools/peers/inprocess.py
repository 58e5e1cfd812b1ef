"""The in-process closed loop that OpenVINO GenAI's driver and the lab's engine both run (c requests in flight,
the next added as one finishes, greedy under ignore_eos, no HTTP), and its summary row in the servers' fields."""
import time

import numpy as np
from omegaconf import OmegaConf

from engine.core.request import SamplingParams
from engine.engine import LLMEngine
from engine.factory import build_engine
from engine.model.loader import eos_ids
from engine.specs import PolicySpec
from pipeline.config import build_net, compose_config, load_source
from pipeline.measuring.accuracy import greedy_agreement

LAB = "lab (engine in-process)"


def summary(records: list[dict], wall: float, max_tokens: int, error: str | None = None) -> dict:
    """A closed loop's row: requests, complete (all max_tokens), TTFT p50/p99 (s, from the request's addition),
    throughput (tokens over the wall, /s), per-stream rate (1 / median time per output token after the first)."""
    done = [r for r in records if r and r["first"] is not None]
    ttft = np.array([r["first"] - r["start"] for r in done])
    tpot = np.array([(r["end"] - r["first"]) / (len(r["tokens"]) - 1) for r in done if len(r["tokens"]) > 1])
    tokens = sum(len(r["tokens"]) for r in done)
    return {"requests": len(records), "complete": 0 if error else sum(len(r["tokens"]) == max_tokens for r in done),
            "errors": int(bool(error)) or len(records) - len(done), "first_error": error,
            "throughput_tps": tokens / wall if wall else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "per_stream_tps": float(1 / np.median(tpot)) if len(tpot) else None}


def engine_loop(eng: LLMEngine, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    """The lab's engine under the closed loop: the driver's records and wall (s)."""
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    todo, live, recs = list(enumerate(prompts)), set(), [None] * len(prompts)
    t0 = time.perf_counter()

    def add():
        i, ids = todo.pop(0)
        recs[i] = {"start": time.perf_counter() - t0, "first": None, "end": None, "tokens": []}
        eng.add_request(str(i), ids, params)
        live.add(i)

    while todo and len(live) < c:
        add()
    while live:
        events = eng.step()
        now = time.perf_counter() - t0
        for ev in events:
            i = int(ev.rid)
            if ev.token is not None:
                recs[i]["tokens"].append(ev.token)
                recs[i]["first"] = now if recs[i]["first"] is None else recs[i]["first"]
            if ev.finish_reason:
                recs[i]["end"] = now
                live.discard(i)
                if todo:
                    add()
    return {"records": recs, "wall": time.perf_counter() - t0}


def lab_engine(cfg, level: str, seats: int, seat_tokens: int) -> LLMEngine:
    """The lab's engine at precision `level` as its server runs it: `seats` requests at once, continuous batching."""
    lcfg = OmegaConf.create(OmegaConf.to_container(cfg))
    lcfg.precision = compose_config([f"model={cfg.model.name}", f"precision={level}"]).precision
    source, _ = load_source(lcfg)
    net = build_net(source, lcfg)
    return build_engine(net, PolicySpec("continuous", seats), seat_tokens, eos_ids=eos_ids(net))


def agreement(ref: list[list[int]], got: list[list[int]]) -> str:
    """Greedy agreement with the lab's fp32 outputs, in words."""
    a = greedy_agreement(ref, got)
    first = a["first_divergences"]
    return (f"greedy vs lab fp32: {round(a['greedy_exact'] * len(ref))}/{len(ref)} exact"
            + (f", others diverge from token {min(first)} (median {int(np.median(first))})" if first else ""))
