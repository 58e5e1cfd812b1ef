"""Workloads shaped like production traffic (conf/workload/ with a `lengths` key): lengths from a published quantile
table (`lengths: quantiles`, pipeline.workloads.shapes) or from a user's trace (`lengths: trace`, the file of
load=trace), scaled by `scale` and fitted to the context (max_request_tokens); optional shared prefixes at a target
prefix-cache hit ratio (`prefix`, pipeline.workloads.prefixes). The profile's requests_scale sets the request count;
its output and long-prompt scales do not apply (`scale` does).

The frame has the seed tables' columns plus `clipped`; its attrs carry the workload's description for reports
(workload_meta).
"""
import numpy as np
import pandas as pd

from pipeline.workloads import shapes
from pipeline.workloads.arrivals import arrival_steps
from pipeline.workloads.prefixes import apply_prefixes, hit_ratio, plan_prefixes
from pipeline.workloads.prompts import sized_prompts
from pipeline.workloads.traces import read_trace


def raw_lengths(cfg, rng) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) lengths in tokens at full size: drawn from the tables, or the trace's rows."""
    w = cfg.workload
    if w.lengths == "quantiles":
        n = max(1, round(w.num_requests * cfg.profile.requests_scale))
        return (shapes.draw(rng, n, w.input.percentiles, w.input.tokens),
                shapes.draw(rng, n, w.output.percentiles, w.output.tokens))
    if w.lengths == "trace":
        if cfg.load.process != "trace":
            raise ValueError("workload trace takes its lengths from load=trace's file: add load=trace load.file=...")
        t = read_trace(cfg.load.file)
        n = len(t) if w.num_requests is None else max(1, round(w.num_requests * cfg.profile.requests_scale))
        return t["input_tokens"].to_numpy()[:n], t["output_tokens"].to_numpy()[:n]
    raise ValueError(f"workload.lengths {w.lengths!r}: choose quantiles or trace")


def block_tokens(w) -> int:
    """Tokens in one shared-prefix block after scaling (at least 1)."""
    return max(1, round(int(w.prefix.block_tokens) / float(w.scale)))


def build_shaped(cfg, tokenizer=None, vocab_size: int = 512) -> pd.DataFrame:
    """One row per request: rid, is_long (prompt in the top tenth), prompt (token ids), prompt_tokens,
    output_tokens, arrival_steps, clipped; and session where the prefixes come in conversations."""
    w, seed = cfg.workload, int(cfg.seed)
    rng = np.random.default_rng(seed)
    raw_in, raw_out = raw_lengths(cfg, rng)
    inp, out, clipped = shapes.fit_context(shapes.scaled(raw_in, w.scale), shapes.scaled(raw_out, w.scale),
                                           int(cfg.max_request_tokens))
    n = len(inp)
    arrivals = arrival_steps(rng, n, cfg.load, float(out.mean()))
    prompts = sized_prompts(inp, tokenizer, vocab_size, seed)
    talks = None  # conversation per request (prefix.sessions of them, drawn uniformly)
    if w.get("prefix"):
        p = w.prefix
        talks = rng.integers(int(p.sessions), size=n) if p.get("sessions") else None
        prompts = apply_prefixes(prompts, plan_prefixes(rng, inp, float(p.cache_ratio), block_tokens(w),
                                                        int(p.window), talks))
    df = pd.DataFrame({"rid": [f"r{i:04d}" for i in range(n)], "is_long": top_tenth(inp),
                       "prompt": prompts, "prompt_tokens": inp, "output_tokens": out, "arrival_steps": arrivals,
                       "clipped": clipped})
    if talks is not None:
        df["session"] = [f"s{t:04d}" for t in talks]
    df.attrs = workload_meta(cfg, df)
    return df


def top_tenth(lengths) -> np.ndarray:
    """True for the longest tenth of the prompts (at least one; ties in request order)."""
    rank = np.argsort(np.argsort(-np.asarray(lengths), kind="stable"), kind="stable")
    return rank < max(1, len(rank) // 10)


def workload_meta(cfg, df: pd.DataFrame) -> dict:
    """What a report prints about a shaped workload: its lengths' label ("Azure conv lengths / 8"), source, scale,
    the context and how many requests were clipped to it, and the prefix blocks and hit ratio when shared."""
    w = cfg.workload
    meta = {"workload": w.name, "lengths": shapes.label(w), "source": w.source, "scale": float(w.scale),
            "context_tokens": int(cfg.max_request_tokens), "clipped": int(df["clipped"].sum()), "requests": len(df)}
    if w.get("prefix"):
        b = block_tokens(w)
        meta.update({"prefix_block_tokens": b, "prefix_hit_ratio": hit_ratio(list(df["prompt"]), b)})
    return meta
