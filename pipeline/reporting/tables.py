"""The seeds' tables, rendered from results, each figure labelled measured or computed; and their metric keys.

Each table function (TABLES, sweep) takes summary rows (dicts from data/results/engine/<table>.json) and returns
(markdown, metrics), metrics being flat `<table>.<run>.<metric>` keys for reports/metrics.json; cache, cost_model,
validation and precision take their results file instead, and sweep_table and goodput_knees return markdown alone.
"""
import math

from engine.core.simulator import UNITS


def fmt(v, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def run_key(row: dict) -> str:
    """A short, stable name for one run: policy, its knob, and what the table sweeps."""
    key = row["policy"]
    if row["policy"] == "chunked" and "token_budget" in row:
        key += f"-{int(row['token_budget'])}"
    if row["policy"] == "dynamic" and "max_wait_ms" in row and row["table"] == "dynamic_timeouts":
        key += f"-{int(row['max_wait_ms'])}ms"
    if row["table"] == "dynamic_timeouts":
        key = f"load{row['load_multiple']:g}.{key}"
    if row["table"] == "static_efficiency":
        key = f"sigma{row['sigma']:g}"
    if row["table"] == "kv_memory":
        key = f"load{row['load_multiple']:g}.{row['kv']}"
    if row["table"] == "shared_prefix":
        key = f"S{row['shared_prefix_tokens']}.N{row['requests']}.{'cached' if row['prefix_caching'] else 'uncached'}"
    if row["table"] == "preemption":
        key = f"blocks{row['num_blocks']}"
    if row["table"] == "precision_policies":
        key = f"{row.get('precision', 'fp32')}.{key}"
    return key


def accuracy_of(prec: dict | None, level: str, tag: str | None = None) -> str:
    """A level's accuracy against fp32 in words (reports/precision.json), for every table that shows its speed; tag:
    its accuracy tier where one was measured (PEER.md), else lossless or lossy by precision.json's rule."""
    if level == (prec or {}).get("reference", "fp32"):
        return "reference"
    got = (prec or {}).get("levels", {}).get(level)
    if not got:
        return tag or "not measured"
    tag = tag or ("lossless" if got["lossless"] else "lossy")
    return f"{tag}: KLD {got['kld_mean']:.1e}, top-1 {got['top1']:.2%}"


def cache_name(r: dict) -> str:
    """The KV cache of a run in words: slot seats, or a paged pool."""
    if r["kv"] != "paged":
        return f"slot, {int(r['max_running'])} seats"
    return f"paged, {r['num_blocks']} blocks of {r['block_size']}, up to {int(r['max_running'])} running"


def markdown(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return "\n".join(out)


def metrics_of(rows: list[dict], names: list[str]) -> dict:
    return {f"{r['table']}.{run_key(r)}.{m}": round(float(r[m]), 4) for r in rows for m in names
            if m in r and r[m] is not None and not (isinstance(r[m], float) and math.isnan(r[m]))}


def static_efficiency(rows):
    body = [[fmt(r["sigma"], 1), fmt(r["length_cv"]), fmt(r["predicted_static_efficiency"]), fmt(r["slot_efficiency"]),
             fmt(abs(r["slot_efficiency"] - r["predicted_static_efficiency"]), 4), fmt(r["live_rows"], 1),
             fmt(r["throughput_tps"], 1)] for r in rows]
    md = markdown(["output-length sigma", "length CV (computed)", "slot efficiency, expected (computed)",
                   "slot efficiency (measured)", "difference", "live rows per step (measured)",
                   "throughput, tok/s (measured)"], body)
    return md, metrics_of(rows, ["slot_efficiency", "predicted_static_efficiency", "throughput_tps", "live_rows"])


def dynamic_timeouts(rows):
    body = [[fmt(r["load_multiple"]),
             r["policy"] + (f", wait {r['max_wait_ms'] / 1000:g} s" if r["policy"] == "dynamic" else ""),
             fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]), fmt(r["throughput_tps"], 1), fmt(r["slot_efficiency"]),
             fmt(r["live_rows"], 1), fmt(sum(r["batch_sizes"]) / max(len(r["batch_sizes"]), 1), 1),
             f"{r['complete']}/{r['requests']}"] for r in rows]
    md = markdown(["load (x capacity)", "policy", "TTFT p50, s", "TTFT p99, s", "throughput, tok/s",
                   "slot efficiency", "live rows per step", "mean batch launched", "complete"], body)
    return md + "\n\nAll measured.", metrics_of(rows, ["ttft_p50_s", "ttft_p99_s", "throughput_tps", "slot_efficiency"])


def all_policies(rows):
    body = [[r["policy"] + (" (oracle)" if r["policy"] == "bucketed" else ""), fmt(r["throughput_tps"], 1),
             fmt(r["goodput_tps"], 1), fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]), fmt(r["tpot_p50_s"] * 1e3, 0),
             fmt(r["itl_p99_s"] * 1e3, 0), fmt(r["slot_efficiency"])] for r in rows]
    md = markdown(["policy", "throughput, tok/s", "goodput, tok/s", "TTFT p50, s", "TTFT p99, s", "TPOT p50, ms",
                   "ITL p99, ms", "slot efficiency"], body)
    return md + "\n\nAll measured.", metrics_of(
        rows, ["throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s",
               "slot_efficiency"])


def prefill_stall(rows):
    name = {"continuous": "prefill-first", "mixed": "mixed"}
    body = [[name.get(r["policy"], f"chunked, budget {int(r.get('token_budget', 0))}"), fmt(r.get("ttft_long_p50_s")),
             fmt(r.get("ttft_short_p50_s")), fmt(r["itl_p50_s"] * 1e3, 0), fmt(r["itl_p99_s"] * 1e3, 0),
             fmt(r["itl_max_s"] * 1e3, 0), fmt(r["max_step_s"] * 1e3, 0), fmt(r["throughput_tps"], 1)] for r in rows]
    md = markdown(["policy", "long-prompt TTFT p50, s", "short-prompt TTFT p50, s", "ITL p50, ms", "ITL p99, ms",
                   "ITL max, ms", "max step, ms", "throughput, tok/s"], body)
    return md + "\n\nAll measured.", metrics_of(
        rows, ["ttft_long_p50_s", "ttft_short_p50_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "max_step_s",
               "throughput_tps"])


def cache(result: dict):
    rows = result["rows"]
    body = [[r["context"], fmt(r["cat_append_ms"]), fmt(r["slot_append_ms"]), fmt(r["cat_copied_mb"], 0),
             fmt(r["cat_decode_ms"], 1), fmt(r["slot_decode_ms"], 1)] for r in rows]
    md = markdown(["context", "append via cat, ms", "append in place, ms", "cat copies, MB (computed)",
                   "decode step, cat engine, ms", "decode step, slot engine, ms"], body)
    metrics = {f"cache.ctx{r['context']}.{k}": round(r[k], 3) for r in rows
               for k in ("cat_append_ms", "slot_append_ms", "cat_decode_ms", "slot_decode_ms")}
    return md + f"\n\nBatch {result['batch']}; all measured except the copied bytes.", metrics


def cost_model(result: dict):
    c, f = result["cost_model"], result["fit"]
    coef = markdown(["term", "fitted", "unit"], [["fixed", fmt(c["fixed"] * 1e3, 3), "ms per step"]] + [
        [name, fmt(v * 1e6, 4), UNITS[name].replace("s per", "µs per", 1)] for name, v in c["coef"].items()])
    per_kind = markdown(["steps", "count", "median error", "p90 error", "R²"],
                     [[k, v["steps"], f"{v['median_rel_error']:.1%}", f"{v['p90_rel_error']:.1%}", fmt(v["r2"], 3)]
                      for k, v in [("all", f), *f["per_kind"].items()]])
    knee = markdown(["knee, prompt tokens per step", "knee from the ridge, tokens (computed)"],
                    [[fmt(result["knee_tokens"], 0), fmt(result["knee_from_ridge_tokens"], 0)]])
    metrics = {"cost_model.knee_tokens": round(result["knee_tokens"], 1),
               "cost_model.median_rel_error": round(f["median_rel_error"], 4),
               **{f"cost_model.{k}.median_rel_error": round(v["median_rel_error"], 4)
                  for k, v in f["per_kind"].items()}}
    fp = result.get("first_principles")
    if fp:
        per_kind += "\n\n" + markdown(
            ["steps", "fitted: median error", "first principles (computed): median error", "p90 error"],
            [[k, f"{fv['median_rel_error']:.1%}", f"{pv['median_rel_error']:.1%}", f"{pv['p90_rel_error']:.1%}"]
             for k, fv, pv in [("all", f, fp), *((k, f["per_kind"][k], v) for k, v in fp["per_kind"].items())]])
        per_kind += (f"\n\nFirst principles: the GPU reports' roofline method (pipeline/modeling/roofline.py) on this "
                     f"CPU's probe, {fp['bandwidth_gbs']:.1f} GB/s and {fp['gflops']:.0f} GFLOP/s measured, "
                     f"{fp['bytes_per_weight']:.2f} bytes a weight, every efficiency term at 1 and no fixed cost: "
                     "the one place the method's error shows against measured steps.")
        metrics["cost_model.first_principles.median_rel_error"] = round(fp["median_rel_error"], 4)
    busy = (" Every replay was disturbed (other work took CPU time while it ran): the fit includes them, and its "
            "coefficients are those of a busy machine.") if f.get("disturbed") else ""
    return (f"{coef}\n\nFit error by kind of step:\n\n{per_kind}\n\n{knee}\n\n"
            f"Fitted to {f['steps']} measured steps.{busy}"), metrics


def validation(sim: dict):
    st = sim["validation_stats"]
    names = {"throughput_tps": "throughput", "ttft_p50_s": "TTFT p50", "tpot_p50_s": "TPOT p50"}
    md = markdown(["metric", "Spearman, real vs simulated", "median relative error"],
                  [[names[m], fmt(v["spearman"]), f"{v['median_rel_error']:.1%}"] for m, v in st.items()])
    t = sim["timing"]
    md += (f"\n\n{len(sim['validation'])} real runs replayed in simulation. Sweep: {t['sweep_points']} simulated "
           f"runs in {t['sweep_s']:.1f} s ({t['points_per_s']:.0f} per second).")
    return md, {f"simulation.{m}.{k}": round(v[k], 4) for m, v in st.items() for k in v}


def sweep_table(sim: dict, axis: str, label: str, extra: tuple = ()):
    rows = [r for r in sim["sweeps"] if r["axis"] == axis]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    values = list(dict.fromkeys(r["value"] for r in rows))
    get = {(r["value"], r["policy"]): r for r in rows}
    header = [label, *[f"{p} tok/s" for p in policies], *[f"{p} goodput" for p in policies],
              *[f"{p} TTFT p99, s" for p in policies], *[e[1] for e in extra]]
    body = [[fmt(float(v)), *[fmt(get[v, p]["throughput_tps"], 1) for p in policies],
             *[fmt(get[v, p]["goodput_tps"], 1) for p in policies],
             *[fmt(get[v, p]["ttft_p99_s"]) for p in policies],
             *[e[2](get[v, policies[0]]) for e in extra]] for v in values]
    return markdown(header, body) + "\n\nSimulated (median of 3 seeds)."


def goodput_knees(sim: dict) -> str:
    """The load at which each policy's goodput peaks (past it, more load only adds missed deadlines)."""
    rows = [r for r in sim["sweeps"] if r["axis"] == "load.multiple"]
    out = []
    for p in dict.fromkeys(r["policy"] for r in rows):
        best = max((r for r in rows if r["policy"] == p), key=lambda r: r["goodput_tps"])
        out.append([p, fmt(float(best["value"]), 1), fmt(best["goodput_tps"], 1)])
    return markdown(["policy", "load at peak goodput (x capacity)", "peak goodput, tok/s"], out) + "\n\nSimulated."


def kv_memory(rows):
    slot = {r["load_multiple"]: r for r in rows if r["kv"] == "slot"}
    body = [[fmt(r["load_multiple"], 1), cache_name(r), r["peak_running"], fmt(r["throughput_tps"], 1),
             fmt(r["goodput_tps"], 1), fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]), r["preemptions"],
             r["kv_reserved_peak_tokens"], r["kv_held_peak_tokens"], fmt(1 - r["kv_unused"]),
             "yes" if r["tokens_digest"] == slot[r["load_multiple"]]["tokens_digest"] else "no",
             f"{r['complete']}/{r['requests']}"] for r in rows]
    md = markdown(["load (x capacity)", "KV cache", "peak running", "throughput, tok/s", "goodput, tok/s",
                   "TTFT p50, s", "TTFT p99, s", "preemptions", "KV reserved at peak, tokens",
                   "KV held at peak, tokens",
                   "tokens held per token reserved", "tokens equal to slot", "complete"], body)
    ratios = []
    for r in rows:
        s = slot[r["load_multiple"]]
        if r["kv"] == "paged":
            ratios.append([fmt(r["load_multiple"], 1), fmt(r["peak_running"] / s["peak_running"], 2),
                           fmt(r["ttft_p99_s"] / s["ttft_p99_s"], 2),
                           fmt(r["throughput_tps"] / s["throughput_tps"], 2)])
    md += "\n\nPaged against slot at the same load:\n\n" + markdown(
        ["load (x capacity)", "peak running, ratio", "TTFT p99, ratio", "throughput, ratio"], ratios)
    return md + ("\n\nAll measured. Tokens held per token reserved: the requests' K/V tokens over the memory "
                 "reserved for them, summed over steps (1 - that is the reserved KV that sits unused); above 1 on "
                 "the paged pool, where requests sharing a prompt's start hold one copy of its blocks."), metrics_of(
        rows, ["peak_running", "throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s", "preemptions", "kv_unused"])


def shared_prefix(rows):
    uncached = {(r["shared_prefix_tokens"], r["requests"]): r for r in rows if not r["prefix_caching"]}
    body = []
    for r in rows:
        base = uncached[r["shared_prefix_tokens"], r["requests"]]
        body.append([r["shared_prefix_tokens"], r["requests"], "on" if r["prefix_caching"] else "off",
                     r["cached_tokens"], r.get("expected_cached_tokens", 0), r["prompt_tokens_computed"],
                     base["prompt_tokens_computed"] - r["prompt_tokens_computed"], fmt(r["ttft_p50_s"]),
                     fmt(r["ttft_p99_s"]), fmt(r["ttft_p50_s"] / base["ttft_p50_s"], 2), fmt(r["throughput_tps"], 1),
                     "yes" if r["tokens_digest"] == base["tokens_digest"] else "no"])
    md = markdown(["shared prefix, tokens", "requests", "prefix cache", "hit tokens", "expected hit tokens (computed)",
                   "prompt tokens computed", "computed tokens saved", "TTFT p50, s", "TTFT p99, s",
                   "TTFT p50, ratio to uncached", "throughput, tok/s", "tokens equal to uncached"], body)
    return md + "\n\nAll measured except the expectation.", metrics_of(
        rows, ["cached_tokens", "expected_cached_tokens", "prompt_tokens_computed", "ttft_p50_s", "ttft_p99_s",
               "throughput_tps"])


def preemption(rows):
    big = max(rows, key=lambda r: r["num_blocks"])
    body = [[cache_name(r), r["preemptions"], r["recomputed_tokens"], f"{r['complete']}/{r['requests']}",
             fmt(r["throughput_tps"], 1), fmt(r["throughput_tps"] / big["throughput_tps"], 2), fmt(r["ttft_p50_s"]),
             fmt(r["ttft_p99_s"]), fmt(r["max_gap_p99_s"]),
             "yes" if r["tokens_digest"] == big["tokens_digest"] else "no"] for r in rows]
    md = markdown(["KV cache", "preemptions", "recomputed tokens", "complete", "throughput, tok/s",
                   "throughput, ratio to the largest pool", "TTFT p50, s", "TTFT p99, s", "max gap p99, s",
                   "tokens equal to the largest pool"], body)
    return md + "\n\nAll measured.", metrics_of(
        rows, ["preemptions", "recomputed_tokens", "throughput_tps", "ttft_p50_s", "ttft_p99_s", "max_gap_p99_s"])


TABLES = {"static_efficiency": static_efficiency, "dynamic_timeouts": dynamic_timeouts,
          "prefill_stall": prefill_stall, "all_policies": all_policies, "main": all_policies, "kv_memory": kv_memory,
          "shared_prefix": shared_prefix, "preemption": preemption}


def sweep(rows):
    """Any runs, one line each, named by their overrides (a Hydra multirun)."""
    body = [[r["point"], fmt(r["throughput_tps"], 1), fmt(r["goodput_tps"], 1), fmt(r["ttft_p50_s"]),
             fmt(r["ttft_p99_s"]), fmt(r["tpot_p50_s"] * 1e3, 0), fmt(r["itl_p99_s"] * 1e3, 0),
             f"{r['complete']}/{r['requests']}"] for r in rows]
    md = markdown(["run", "throughput, tok/s", "goodput, tok/s", "TTFT p50, s", "TTFT p99, s", "TPOT p50, ms",
                   "ITL p99, ms", "complete"], body)
    return md + "\n\nAll measured.", metrics_of(rows, ["throughput_tps", "goodput_tps", "ttft_p99_s"])


def precision(prec: dict):
    """reports/precision.json: each level against fp32, beside the noise floor."""
    f = prec["noise_floor"]
    rows = [["noise floor: " + n, *(fmt(v[k], 8) for k in ("kld_mean", "kld_p99", "kld_max")),
             f"{v['top1']:.4%}", f"{v['top1_no_ties']:.4%}", fmt(v["ppl_delta"], 6), "", ""]
            for n, v in f["comparisons"].items()]
    rows += [[name, *(fmt(v[k], 8) for k in ("kld_mean", "kld_p99", "kld_max")), f"{v['top1']:.4%}",
              f"{v['top1_no_ties']:.4%}", fmt(v["ppl_delta"], 6), f"{v['greedy_exact']:.0%}",
              "yes" if v["lossless"] else "no"] for name, v in prec["levels"].items()]
    md = markdown(["against fp32", "KLD mean", "KLD p99", "KLD max", "top-1", "top-1 without near-ties",
                   "perplexity change", "greedy requests equal", "lossless"], rows)
    metrics = {f"precision.{name}.{k}": v[k] for name, v in prec["levels"].items()
               for k in ("kld_mean", "top1", "top1_no_ties", "ppl_delta", "greedy_exact")}
    metrics["precision.noise_floor.kld_mean"] = f["kld_mean"]
    return md, metrics
