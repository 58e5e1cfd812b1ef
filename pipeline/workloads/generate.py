"""Workloads as data: prompts, output lengths and arrival times generated ahead from a seeded RNG.

Arrivals are in units of the full-batch decode step (`arrival_steps`); a replay turns them into seconds with the
step time it measures, so `load.multiple` means the same fraction of capacity on any machine.
Capacity: `load.ref_seats` rows decoding per step, so at load.multiple 1 a request arrives every
(mean output length / ref_seats) steps.
"""
import math

import numpy as np
import pandas as pd

from engine.model.loader import load_tokenizer
from pipeline.config import model_spec
from pipeline.workloads.arrivals import arrival_steps
from pipeline.workloads.prompts import long_prompts, short_prompts
from pipeline.workloads.runs import runs
from pipeline.workloads.shaped import build_shaped


def output_lengths(rng, n: int, mean: float, sigma: float, max_len: int) -> np.ndarray:
    """Lognormal lengths with the given mean and sigma of log-length, rounded and clipped to [1, max_len]."""
    mu = math.log(mean) - sigma ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_len).astype(int)


def tokenizer_and_vocab(cfg):
    """(tokenizer or None, vocabulary size) of the configured model, for building prompts."""
    tok = load_tokenizer(model_spec(cfg.model))
    return tok, len(tok) if tok is not None else int(cfg.model.config.vocab_size)


def build(cfg, tokenizer=None, vocab_size: int = 512) -> pd.DataFrame:
    """One row per request: rid, is_long, prompt (token ids), prompt_tokens, output_tokens, arrival_steps. A workload
    with `lengths` (production-shaped) is built by pipeline.workloads.shaped."""
    w, prof = cfg.workload, cfg.profile
    if "lengths" in w:
        return build_shaped(cfg, tokenizer, vocab_size)
    rng = np.random.default_rng(int(cfg.seed))
    n = max(1, round(w.num_requests * prof.requests_scale))
    out = output_lengths(rng, n, w.output.mean * prof.output_scale, float(w.output.sigma),
                         int(w.output.max * prof.output_scale))
    is_long = rng.random(n) < float(w.long_fraction)
    arrivals = arrival_steps(rng, n, cfg.load, float(out.mean()))
    short = short_prompts(n, tokenizer, vocab_size, int(cfg.seed))
    order = rng.permutation(n)
    long_ = long_prompts(int(is_long.sum()), int(w.long_tokens * prof.long_scale), tokenizer, vocab_size,
                         int(cfg.seed)) if is_long.any() else []
    it = iter(long_)
    prompts = [next(it) if is_long[i] else short[order[i]] for i in range(n)]
    shared = int(w.get("shared_prefix_tokens", 0))  # tokens of one system preamble that every prompt starts with
    if shared:  # the prompts' own common start (a chat template's header) dropped: they differ right after it
        prefix = long_prompts(1, shared, tokenizer, vocab_size, int(cfg.seed) + 1)[0]
        own = common_prefix(prompts) if n > 1 else 0
        prompts = [prefix + p[own:] for p in prompts]
    return pd.DataFrame({"rid": [f"r{i:04d}" for i in range(n)], "is_long": is_long, "prompt": prompts,
                         "prompt_tokens": [len(p) for p in prompts], "output_tokens": out,
                         "arrival_steps": arrivals})


def common_prefix(seqs) -> int:
    """Length of the longest start that all the sequences share."""
    first = seqs[0]
    n = min(map(len, seqs))
    return next((i for i in range(n) if any(s[i] != first[i] for s in seqs)), n)


def expected_prefix_hits(prompts, first_wave: int, block_size: int) -> int:
    """Prefix-cache hit tokens expected from the prompts alone, in arrival order: the first `first_wave` are admitted
    together and find nothing; each later one reuses the whole blocks of its longest common start with any earlier
    prompt, at most its length - 1 tokens."""
    hits = 0
    for j in range(first_wave, len(prompts)):
        best = max(common_prefix([prompts[i], prompts[j]]) for i in range(j))
        hits += min(best, len(prompts[j]) - 1) // block_size * block_size
    return hits


def predicted_static_efficiency(lengths, batch: int) -> float:
    """Static slot efficiency from the workload alone: total length / the sum over batches (in arrival order) of
    their size x their longest length."""
    lengths = list(lengths)
    maxima = [max(lengths[i:i + batch]) for i in range(0, len(lengths), batch)]
    sizes = [len(lengths[i:i + batch]) for i in range(0, len(lengths), batch)]
    return sum(lengths) / sum(m * s for m, s in zip(maxima, sizes))


def table_workloads(cfg, table: str, tokenizer=None, vocab_size: int = 512) -> pd.DataFrame:
    """Every run's workload of a table, one frame with a `point` column naming the run; its attrs["workloads"] maps
    each production-shaped run to its description (pipeline.workloads.shaped.workload_meta)."""
    built = [(name, build(run_cfg, tokenizer, vocab_size)) for name, run_cfg in runs(cfg, table)]
    out = pd.concat([wl.assign(point=name) for name, wl in built], ignore_index=True)
    shaped = {name: dict(wl.attrs) for name, wl in built if wl.attrs}
    out.attrs = {"workloads": shaped} if shaped else {}
    return out
