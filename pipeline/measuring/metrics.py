"""Every summary figure, defined once. Engine replays and server runs both reach here with the same records.

Per-request records: arrival, first_token, finish (s), token_times (s, one per output token), num_tokens, complete.
Per-step records: duration (s), useful_rows, computed_rows, kind, num_prompt_tokens, cached_tokens (prefix-cache
hits admitted), preempted, num_running, kv_tokens (tokens whose K/V are held) and kv_reserved_tokens (held or
reserved: whole seats on the slot cache, whole blocks on the paged one).

- TTFT  = first token time - arrival.
- TPOT  = (last token time - first token time) / (tokens - 1): the first token excluded, as in vLLM.
- ITL   = every gap between consecutive tokens of one request, pooled over requests.
- max gap = the largest ITL of a request (a prefill stall shows up here).
- throughput = output tokens of all requests / wall time (first arrival to last token).
- a request meets the SLO when it completed within both the TTFT and the TPOT limit; a run meets it when at least
  slo.share of its requests do (conf/slo: 0.99, a p99 promise).
- goodput = output tokens of requests that met the SLO / wall time (DistServe).
- slot efficiency = useful rows / computed rows (a zombie row is computed, not useful).
- live rows = useful rows per step, averaged over steps.
- KV unused = 1 - (K/V tokens held) / (tokens reserved), summed over steps (seed 003 §7, measured).
- recomputed tokens = prompt tokens computed - padding - (admitted requests' prompt tokens - prefix-cache hits): the
  work preemption repeats (exact without prefix caching; with it, a resumed request's re-found blocks count as
  recomputed).
"""
import numpy as np
import pandas as pd


def pct(values, q: float) -> float:
    """The q-th percentile (0-100), NaN when there are no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def per_request(req: pd.DataFrame) -> pd.DataFrame:
    """A copy with ttft, tpot and max_gap columns (s)."""
    df = req.copy()
    df["ttft"] = df["first_token"] - df["arrival"]
    df["tpot"] = [(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else np.nan for t in df["token_times"]]
    df["max_gap"] = [float(np.max(np.diff(t))) if len(t) > 1 else np.nan for t in df["token_times"]]
    return df


def summarize(req: pd.DataFrame, steps: pd.DataFrame | None = None, ttft_limit: float = float("inf"),
              tpot_limit: float = float("inf")) -> dict:
    """The summary row of one run."""
    df = per_request(req)
    done = df[df["num_tokens"] > 0]
    itl = np.concatenate([np.diff(t) for t in done["token_times"] if len(t) > 1] or [np.array([])])
    start = df["arrival"].min()
    end = max(t[-1] for t in done["token_times"]) if len(done) else start
    wall = float(end - start) if len(done) else float("nan")
    tokens = int(df["num_tokens"].sum())
    good = df["complete"] & (df["ttft"] <= ttft_limit) & (df["tpot"].fillna(0.0) <= tpot_limit)
    out = {
        "requests": int(len(df)), "complete": int(df["complete"].sum()), "tokens": tokens, "wall_s": wall,
        "throughput_tps": tokens / wall if wall and wall > 0 else 0.0,  # no token came: nothing was served
        "goodput_tps": int(df.loc[good, "num_tokens"].sum()) / wall if wall and wall > 0 else 0.0,
        "slo_met": float(good.mean()) if len(df) else float("nan"),
        "ttft_p50_s": pct(done["ttft"], 50), "ttft_p99_s": pct(done["ttft"], 99),
        "tpot_p50_s": pct(done["tpot"].dropna(), 50), "tpot_p99_s": pct(done["tpot"].dropna(), 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "itl_max_s": float(itl.max()) if len(itl) else float("nan"),
        "max_gap_p99_s": pct(done["max_gap"].dropna(), 99),
    }
    for name, part in (("long", done[done["is_long"]]), ("short", done[~done["is_long"]])) if "is_long" in done else ():
        out[f"ttft_{name}_p50_s"] = pct(part["ttft"], 50)
    if steps is not None and len(steps):
        out["slot_efficiency"] = float(steps["useful_rows"].sum() / max(steps["computed_rows"].sum(), 1))
        out["live_rows"] = float(steps["useful_rows"].mean())
        out["max_step_s"] = float(steps["duration"].max())
        out["steps"] = int(len(steps))
        if "cached_tokens" in steps:
            out["prompt_tokens_computed"] = int(steps["num_prompt_tokens"].sum())
            out["cached_tokens"] = int(steps["cached_tokens"].sum())
            out["preemptions"] = int(steps["preempted"].sum())
            # prompt tokens fed again after a preemption: computed beyond the padding and each admitted prompt's own
            # uncached tokens once
            admitted = int(df.loc[df["admit"].notna(), "prompt_tokens"].sum()) if "admit" in df else 0
            pads = int(steps["num_pad_tokens"].sum()) if "num_pad_tokens" in steps else 0
            out["recomputed_tokens"] = out["prompt_tokens_computed"] - pads - (admitted - out["cached_tokens"])
        if "num_running" in steps:
            out["peak_running"] = int(steps["num_running"].max())
            out["kv_reserved_peak_tokens"] = int(steps["kv_reserved_tokens"].max())
            out["kv_held_peak_tokens"] = int(steps["kv_tokens"].max())
            out["kv_unused"] = 1 - float(steps["kv_tokens"].sum() / max(steps["kv_reserved_tokens"].sum(), 1))
    return out


def meets_slo(row: dict, share: float) -> bool:
    """A summary row (summarize) meets the SLO: at least `share` (slo.share) of its requests did."""
    return row.get("slo_met", 0.0) >= share


def meets_limits(row: dict, ttft_limit: float, tpot_limit: float) -> bool:
    """A summary row's p99 TTFT and p50 TPOT within the limits (s); a run whose requests made one token each (no
    TPOT) is judged on TTFT alone."""
    tpot = row.get("tpot_p50_s")
    return row.get("ttft_p99_s", float("inf")) <= ttft_limit and (tpot is None or tpot != tpot or tpot <= tpot_limit)


def capacity_at_slo(rows: list[dict], ttft_limit: float, tpot_limit: float, rate: str = "rate_rps") -> float:
    """The largest `rate` among summary rows at several loads whose p99 TTFT and p50 TPOT meet the limits
    (meets_limits); 0.0 when none does."""
    return max((float(r[rate]) for r in rows if meets_limits(r, ttft_limit, tpot_limit)), default=0.0)


def slo_limits(slo, step_s: float) -> tuple[float, float]:
    """(TTFT, TPOT) limits in seconds for a conf/slo entry: absolute (ttft_s, tpot_s), or multiples of the
    measured full-batch decode step (ttft_steps, tpot_steps)."""
    if "ttft_s" in slo:
        return float(slo.ttft_s), float(slo.tpot_s)
    return float(slo.ttft_steps) * step_s, float(slo.tpot_steps) * step_s
