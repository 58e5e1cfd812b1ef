"""reports/fleet/FLEET.md and its plot: routers, prefill and decode apart, the planner; every figure computed."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.reporting.computed import NOTE  # noqa: E402
from pipeline.reporting.tables import fmt, markdown  # noqa: E402
from pipeline.results import write_figure  # noqa: E402


def routers_section(rows: list[dict]) -> str:
    body = [[r["workload"], f"{r['multiple']:g}x ({r['rate']:.3g} req/s)", r["router"], f"{r['prefix_hit_rate']:.3f}",
             fmt(r["ttft_p50_s"], 3), fmt(r["ttft_p99_s"], 3), fmt(r["tpot_p50_s"] * 1e3, 1),
             fmt(r["throughput_tps"], 0), fmt(r["goodput_tps"], 0), " / ".join(map(str, r["served"]))]
            for r in rows]
    return markdown(["workload", "load", "router (computed)", "prefix hit rate", "TTFT p50 s", "TTFT p99 s",
                     "TPOT p50 ms", "tok/s", "goodput tok/s", "requests per replica"], body)


def router_verdicts(rows: list[dict]) -> str:
    """Per workload and load: the prefix-aware router against round-robin, as ratios."""
    lines = []
    for key in dict.fromkeys((r["workload"], r["multiple"]) for r in rows):
        by = {r["router"]: r for r in rows if (r["workload"], r["multiple"]) == key}
        rr, pa = by["round_robin"], by["prefix_aware"]
        hits = (f"{pa['prefix_hit_rate'] / rr['prefix_hit_rate']:.2f}x its hit rate" if rr["prefix_hit_rate"]
                else f"hit rate {pa['prefix_hit_rate']:.3f} against none")
        lines.append(f"- {key[0]} at {key[1]:g}x: prefix_aware has {pa['ttft_p99_s'] / rr['ttft_p99_s']:.2f}x "
                     f"round-robin's TTFT p99 and {hits}.")
    return "\n".join(lines)


def splits_section(rows: list[dict], slo: dict) -> str:
    body = [[r["workload"], r["layout"], r["gpus"], fmt(r["capacity_rps"], 3), fmt(r["goodput_per_gpu_rps"], 3),
             fmt(r["ttft_p99_s"], 3), fmt((r["tpot_p99_s"] or float("nan")) * 1e3, 1), binding(r, slo)]
            for r in rows]
    return markdown(["workload", "layout", "GPUs", "capacity req/s (computed)", "goodput req/s per GPU",
                     "TTFT p99 s at capacity", "TPOT p99 ms at capacity", "nearer its limit"], body)


def binding(row: dict, slo: dict) -> str:
    """Which SLO limit the run at capacity is closer to (its p99 over the limit)."""
    if row["ttft_p99_s"] is None:
        return "meets nothing"
    ttft, tpot = row["ttft_p99_s"] / slo["ttft_s"], row["tpot_p99_s"] / slo["tpot_s"]
    return f"TTFT ({ttft:.0%} of it)" if ttft >= tpot else f"TPOT ({tpot:.0%} of it)"


def split_verdicts(rows: list[dict], slo: dict) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        best = max(mine, key=lambda r: r["goodput_per_gpu_rps"])
        colo = next(r for r in mine if r["layout"] == "colocated")
        others = [r for r in mine if r is not best]
        why = "; ".join(f"{r['layout']} {r['goodput_per_gpu_rps'] / best['goodput_per_gpu_rps']:.2f}x, nearer its "
                        f"{binding(r, slo)}" for r in others if best["goodput_per_gpu_rps"])
        if best is colo or not colo["goodput_per_gpu_rps"]:
            against = "" if best is colo else " (colocated meets nothing)"
        else:
            against = f" ({best['goodput_per_gpu_rps'] / colo['goodput_per_gpu_rps']:.2f}x colocated)"
        lines.append(f"- {workload}: **{best['layout']} wins** at {best['goodput_per_gpu_rps']:.3g} req/s per GPU"
                     f"{against}; the others: {why}.")
    return "\n".join(lines)


def plan_section(p: dict) -> str:
    body = []
    for item in p["plans"]:
        for r in item["ranked"]:
            body.append([fmt(item["rate"], 3), r["config"], r["gpus"] if r["gpus"] else "none meets",
                         fmt(r.get("capacity_per_gpu"), 3), fmt(r.get("usd_per_m_output_tokens"), 3),
                         fmt(r.get("ttft_p99_s"), 3), fmt((r.get("tpot_p99_s") or float("nan")) * 1e3, 1),
                         "**best**" if r is item["ranked"][0] and r["gpus"] else ""])
    checks = "; ".join(f"{item['rate']:g} req/s: SLO met by {item['check']['slo_met']:.1%} "
                       f"({'meets' if item['check']['meets'] else 'MISSES'})" for item in p["plans"] if item["check"])
    return (markdown(["rate req/s", "configuration (computed)", "GPUs", "capacity req/s per GPU",
                      f"$/M output tokens at ${p['usd_per_gpu_hour']:g}/GPU-h", "TTFT p99 s", "TPOT p99 ms", ""],
                     body)
            + f"\n\nEach best fleet simulated again on the requests of seed {p['check_seed']}: {checks}.")


def gpus_plot(p: dict, title: str, path) -> None:
    """GPUs needed against the rate, one line per router and layout (the fewest over the engine's knobs)."""
    lines: dict[str, dict[float, int]] = {}
    for item in p["plans"]:
        for r in item["ranked"]:
            if r["gpus"]:
                line = lines.setdefault(f"{r['router']}, {r['layout']}", {})
                line[item["rate"]] = min(line.get(item["rate"], r["gpus"]), r["gpus"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, points in lines.items():
        ax.plot(list(points), list(points.values()), marker="o", label=name)
    ax.set_xlabel("request rate, req/s")
    ax.set_ylabel("GPUs needed at the SLO (computed)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig, 120)
    plt.close(fig)


def report(c: dict, plots) -> str:
    """FLEET.md; its plot drawn into `plots`."""
    plots.mkdir(parents=True, exist_ok=True)
    name = f"{c['model']} at {c['precision']} on {c['tp']} x {c['hardware_label']} a replica"
    slo = c["slo"]
    gpus_plot(c["plan"], f"GPUs needed for {c['plan']['workload']}: {name} (computed)", plots / "gpus_vs_rate.png")
    return "\n\n".join([
        f"# Computed: fleets of {name}", NOTE,
        f"Inputs: `conf/hardware/{c['hardware']}.yaml` (its roofline, calibrated as in "
        "[gpu_validation.md](../gpu_validation.md)); each replica the real engine with chunked prefill, paged K/V and "
        f"a prefix cache of {c['kv_tokens_per_replica']:,.0f} tokens (what its memory holds after the weights); "
        f"Poisson arrivals for {c['seconds']:g} s a run, at least {c['requests']} requests (seed {c['seed']}), at the "
        "workload's published lengths; "
        f"SLO `{slo['name']}`: TTFT {slo['ttft_s']:g} s and TPOT {slo['tpot_s'] * 1e3:g} ms for {slo['share']:.0%} "
        f"of the requests. K/V hand-overs cross {c['link_gbs']:g} GB/s (the interconnect on the spec sheet) plus "
        f"{c['latency_s'] * 1e3:g} ms each (an assumption, params' fleet.split.latency_s). Runs start from an empty "
        "fleet, so short ones lean high; the ratios between routers and layouts are what to read.",
        "## Routers over the same replicas (computed)",
        "Loads are multiples of what the replicas decode in full-batch steps of 16 rows; round-robin, least-loaded "
        "(outstanding tokens), power of two, session and prefix-aware (SGLang's rule and defaults) route the same "
        "requests (engine/router.py).",
        routers_section(c["routers"]), router_verdicts(c["routers"]),
        "## Prefill and decode apart against colocated, at equal GPUs (computed)",
        "Capacity: the highest rate a layout serves within the SLO (bisection); goodput per GPU as DistServe defines "
        "it, that rate over the GPUs. The TTFT and TPOT columns are the run at capacity.",
        splits_section(c["splits"], slo), split_verdicts(c["splits"], slo),
        f"## The planner: fewest GPUs for {c['plan']['workload']} (computed)",
        "`python -m pipeline.tools.plan` on the same inputs: each configuration at the fewest GPUs that meet the SLO "
        "at the rate, cheapest first.",
        plan_section(c["plan"]), "![GPUs needed against the request rate](plots/gpus_vs_rate.png)"]) + "\n"
