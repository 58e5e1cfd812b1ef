"""Request lengths drawn from a published quantile table (conf/workload/azure-conv.yaml and its kin), scaled down for
small CPUs and fitted to the model's context.

Drawing: the inverse CDF through the table's points, linear between them (not a fitted curve), at stratified
uniforms. Below the first
quantile the first segment's line runs on to p0, floored at 1 token; above the last, the last segment's line runs on
to p100. Lengths are then divided by the workload's `scale`, rounded, and at least 1 token.
Fitting: a request whose prompt + output exceed the context keeps an output of at most half the context and its
prompt is cut to the rest; such a request is marked `clipped`.
"""
import numpy as np


def knots(percentiles, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative probabilities from 0 to 1, tokens at each): the table with its two ends added."""
    p, v = np.asarray(percentiles, float) / 100, np.asarray(tokens, float)
    if len(p) < 2 or len(p) != len(v):
        raise ValueError(f"a quantile table needs two or more percentiles, each with its tokens: {percentiles}, "
                         f"{tokens}")
    if not (np.all(np.diff(p) > 0) and p[0] > 0 and p[-1] < 1 and np.all(np.diff(v) >= 0) and v[0] >= 1):
        raise ValueError(f"a quantile table runs strictly up in (0, 100) percent, tokens >= 1 and never down: "
                         f"{list(percentiles)} -> {list(tokens)}")
    low = max(1.0, v[0] - p[0] * (v[1] - v[0]) / (p[1] - p[0]))
    high = v[-1] + (1 - p[-1]) * (v[-1] - v[-2]) / (p[-1] - p[-2])
    return np.concatenate([[0.0], p, [1.0]]), np.concatenate([[low], v, [high]])


def draw(rng, n: int, percentiles, tokens) -> np.ndarray:
    """n lengths (tokens, unrounded) from the table's inverse CDF, stratified: one uniform in each 1/n of [0, 1), in
    random order, so that any n draws span the table evenly (their quantiles within 1/n of its own)."""
    u = (rng.permutation(n) + rng.random(n)) / n
    return np.interp(u, *knots(percentiles, tokens))


def table_mean(percentiles, tokens) -> float:
    """The mean length (tokens) of the table's piecewise-linear distribution."""
    p, v = knots(percentiles, tokens)
    return float(np.sum(np.diff(p) * (v[1:] + v[:-1]) / 2))


def scaled(lengths, scale: float) -> np.ndarray:
    """Lengths divided by `scale`, rounded, at least 1 token."""
    return np.maximum(1, np.rint(np.asarray(lengths, float) / float(scale))).astype(int)


def fit_context(inp, out, context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths, clipped) with prompt + output <= context (see the module)."""
    inp, out = np.asarray(inp, int), np.asarray(out, int)
    over = inp + out > context
    out_fit = np.where(over, np.minimum(out, context // 2), out)
    inp_fit = np.where(over, np.minimum(inp, context - out_fit), inp)
    return inp_fit, out_fit, over


def label(workload) -> str:
    """How a report names the lengths: "Azure conv lengths / 8" (no "/ 1" at full size)."""
    scale = float(workload.get("scale", 1))
    return f"{workload.label} lengths" + (f" / {scale:g}" if scale != 1 else "")
