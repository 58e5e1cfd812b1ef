"""REPORT.md's speculation table from data/results/speculation.json: each (workload, batch, k) measured, the
simulator's prediction beside it, where speculation stops paying, and the simulator's rank agreement; metric keys
`speculation.<workload>.b<batch>.<figure>`."""
from pipeline.reporting.tables import fmt, markdown

NOTE = ("B requests at once on the continuous policy, greedy, each to its own end (at most {n} new tokens; greedy "
        "outputs are equal at every k, so a batch's cells do the same work), prompt lookup from {lo} to {hi} tokens "
        "(`speculative=ngram`); adaptive: each step's k in [0, the largest k] from the fitted cost model and each "
        "request's acceptance. `copy`: an instruction to repeat or edit a passage given in the prompt, answered by the "
        "model itself; `chat`: the short chat prompts. ITL: the gaps between a request's steps (tokens of one step "
        "arrive together). Measured, the fastest of the runs; *sim*: the simulator (same scheduler, the fitted cost "
        "model, drafts and acceptance at the cell's measured rates; an adaptive cell at its batch's largest fixed "
        "k's), computed.")


def render(result: dict) -> tuple[str, dict]:
    rows, metrics, table = result["rows"], {}, []
    base = {(r["workload"], r["batch"]): r for r in rows if r["k"] == "0"}
    for r in rows:
        b = base[(r["workload"], r["batch"])]
        chosen = ", ".join(f"{k}: {n}" for k, n in r.get("chosen_k", {}).items()) or "-"
        table.append([r["workload"], str(r["batch"]), r["k"], f"{r['tpot_p50_ms']:.1f} ({r['sim_tpot_p50_ms']:.1f})",
                      f"{r['tpot_p50_ms'] / b['tpot_p50_ms']:.2f}x", fmt(r["itl_p99_ms"], 1),
                      f"{r['throughput_tok_s']:.0f} ({r['sim_throughput_tok_s']:.0f})",
                      f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x",
                      fmt(r.get("acceptance_rate")), fmt(r.get("tokens_per_verified_row")),
                      fmt(r.get("proposed_share")), chosen])
        key = f"speculation.{r['workload']}.b{r['batch']}.k{r['k']}"
        metrics[f"{key}.throughput_ratio"] = round(r["throughput_tok_s"] / b["throughput_tok_s"], 4)
        metrics[f"{key}.tpot_ratio"] = round(r["tpot_p50_ms"] / b["tpot_p50_ms"], 4)
    body = markdown(["workload", "B", "k", "TPOT p50 ms (sim)", "TPOT vs k=0", "ITL p99 ms", "tok/s (sim)",
                     "tok/s vs k=0", "accepted / drafted", "tokens per verified row", "rows drafted",
                     "adaptive: steps per k"], table)
    def at(b):
        return f"B = {b}" if b is not None else "none measured"

    stops = [f"`{w}`: throughput at {at(b['throughput_tok_s'])}, TPOT p50 at {at(b['tpot_p50_ms'])}"
             for w, b in result["stops_paying"].items()]
    fit = result["sim_spearman"]
    differ = [f"{r['workload']} B={r['batch']} k={r['k']}" for r in rows if not r["tokens_equal_k0"]]
    body += ("\n\nWhere speculation stops paying (the smallest batch at which no fixed k gains 3 % over k = 0): "
             + "; ".join(stops) + f". Simulator against measured over the grid: Spearman "
             f"{fit['throughput_tok_s']:.2f} (throughput), {fit['tpot_p50_ms']:.2f} (TPOT p50). Tokens equal to "
             "k = 0's: " + ("every cell." if not differ else "all but " + ", ".join(differ)
                            + " (a near-tie the verification rows decided otherwise)."))
    metrics.update({f"speculation.sim_spearman.{m}": round(v, 4) for m, v in fit.items()})
    return body, metrics


def note(result: dict) -> str:
    lo, hi = result["lookup"]
    return NOTE.format(n=result["max_new_tokens"], lo=lo, hi=hi)
