"""REPORT.md's measured fleet from data/results/fleet.json (pipeline.measuring.fleet): replicas behind the routing
server under each router policy and one server of all the threads, each run measured with the fleet simulator's
prediction beside it (computed), the simulator's agreement, and what the router itself costs."""
from pipeline.reporting.tables import fmt, markdown


def table(rows: list[dict]) -> str:
    body = [[r["workload"], r["router"] or "-", f"{r['replicas']} x {r['threads']} thread(s)",
             f"{r['complete']}/{r['requests']}", r["errors"], f"{r['prefix_hit_rate']:.3f}",
             f"{r['sim_prefix_hit_rate']:.3f}", fmt(r["ttft_p50_s"], 3), fmt(r["sim_ttft_p50_s"], 3),
             fmt(r["ttft_p99_s"], 3), fmt(r["sim_ttft_p99_s"], 3), fmt(r["tpot_p50_s"] * 1e3, 1),
             fmt(r["throughput_tps"], 1), fmt(r["sim_throughput_tps"], 1)] for r in rows]
    return markdown(["workload", "router", "servers", "complete", "errors", "prefix hit rate",
                     "hit rate (computed)", "TTFT p50 s", "TTFT p50 s (computed)", "TTFT p99 s",
                     "TTFT p99 s (computed)", "TPOT p50 ms", "tok/s", "tok/s (computed)"], body)


def verdicts(rows: list[dict]) -> str:
    """Per workload: the best router's TTFT p99 against round-robin's and against one server of all the threads."""
    lines = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        fleet = {r["router"]: r for r in rows if r["workload"] == w and r["router"]}
        one = next(r for r in rows if r["workload"] == w and not r["router"])
        best = min(fleet.values(), key=lambda r: r["ttft_p99_s"])
        pa, rr = fleet["prefix_aware"], fleet["round_robin"]
        lines.append(f"- {w}: prefix_aware {pa['ttft_p99_s'] / rr['ttft_p99_s']:.2f}x round-robin's TTFT p99 "
                     f"(hit rate {pa['prefix_hit_rate']:.3f} against {rr['prefix_hit_rate']:.3f}); the best router, "
                     f"{best['router']}, {best['ttft_p99_s'] / one['ttft_p99_s']:.2f}x the TTFT p99 of one server of "
                     f"{one['threads']} threads.")
    return "\n".join(lines)


def disturbed(rows: list[dict]) -> str:
    bad = [f"{r['workload']} {r['router'] or 'one server'}" for r in rows if r.get("disturbed")]
    return f" **Disturbed (other work took CPU meanwhile; less reliable): {', '.join(bad)}.**" if bad else ""


def render(result: dict) -> tuple[str, str, str, dict]:
    """(title, note, body, metrics.json figures)."""
    ag, oh, rows = result["agreement"], result["overhead"], result["rows"]
    errors = sum(r["errors"] for r in rows)
    fits = ", ".join(f"{t} thread(s): median step error {c['median_rel_error']:.1%} over {c['steps']} steps"
                     for t, c in result["cost_models"].items())
    note = (f"{rows[0]['replicas']} engine servers of {rows[0]['threads']} thread(s) each behind the routing server "
            f"(`python -m servers server=router`), each router policy, and one server of all the threads; each "
            f"workload's requests at a load (x the rate the replicas serve them one at a time: "
            + ", ".join(f"{w} {x:g}x" for w, x in result["loads"].items())
            + ") with Poisson arrivals, the same in every run. Measured; the columns marked computed are the fleet "
            "simulator's prediction "
            f"of the same run (the real scheduler, paged pool and router on cost models fitted in the same process: "
            f"{fits}).")
    body = "\n\n".join([
        table(rows), verdicts(rows),
        "The simulator against the fleet's runs (every router policy on every workload): " + "; ".join(
            f"{m} Spearman {a['spearman']:.2f}, median error {a['median_rel_error']:.0%}" for m, a in ag.items())
        + ". Against the one-server runs, its TTFT p99 errs by " + ", ".join(
            f"{e:+.0%}" for e in ag["ttft_p99_s"]["one_server_rel_errors"])
        + f". Requests lost: {errors} errors over {sum(r['requests'] for r in rows)} requests." + disturbed(rows),
        f"The router's own cost at c = 1: TTFT p50 {oh['router_ttft_p50_s'] * 1e3:.1f} ms through it against "
        f"{oh['direct_ttft_p50_s'] * 1e3:.1f} ms straight to the replica; over {oh['pairs']} pairs of requests "
        f"(one each way in turn, the two of a pair alike in length), the median pair's TTFT through the router is "
        f"{oh['added']:+.1%} off the direct one's."])
    metrics = {"fleet.ttft_p99.spearman": round(ag["ttft_p99_s"]["spearman"], 4),
               "fleet.ttft_p99.median_rel_error": round(ag["ttft_p99_s"]["median_rel_error"], 4),
               "fleet.router_added_ttft_p50": round(oh["added"], 4), "fleet.errors": errors}
    metrics.update({f"fleet.{r['workload']}.{r['router'] or 'one_server'}.ttft_p99_s": round(r["ttft_p99_s"], 4)
                    for r in rows})
    return "A fleet of two, measured: the router's policies", note, body, metrics
