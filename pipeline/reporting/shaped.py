"""REPORT.md's production-shaped sections from data/results/shaped.json (pipeline.modeling.shaped): every policy
measured at one load near capacity beside the seeds' ranking (data/results/engine/all_policies.json), what changed,
the simulator against those runs, the rest of the grid simulated, and capacity at the SLO per policy and shape."""
import pandas as pd

from pipeline.measuring.metrics import meets_limits
from pipeline.modeling.shaped import agreement
from pipeline.reporting.tables import fmt, markdown

NAMES = {"throughput_tps": "throughput", "ttft_p99_s": "TTFT p99"}
ORDER = {"throughput_tps": False, "ttft_p99_s": True}  # metric -> ascending (True: smaller is better)


def ranks(rows: list[dict], metric: str) -> dict[str, int]:
    """policy -> its place (1 best) by `metric` among rows (ties share the better place; no figure: last)."""
    df = pd.DataFrame(rows)
    got = df[metric].astype(float).rank(ascending=ORDER[metric], method="min", na_option="bottom")
    return dict(zip(df["policy"], got.astype(int)))


def cell_name(r: dict) -> str:
    return f"{r['lengths']}, k = {r['burstiness']:g}"


def cells(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(workload, k) -> its rows, in the results' order."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["workload"], r["burstiness"]), []).append(r)
    return out


def measured_table(result: dict, seeds: list[dict]) -> tuple[str, dict]:
    """One row per measured run: its figures, its places by throughput and TTFT p99 beside the seeds', and the
    simulator's figures for the same run."""
    seed_rank = {m: ranks(seeds, m) for m in ORDER}
    body, metrics = [], {}
    for (workload, k), rows in cells(result["measured"]).items():
        place = {m: ranks(rows, m) for m in ORDER}
        for r in rows:
            p = r["policy"]
            body.append([cell_name(r), p, fmt(r["rate_rps"]), fmt(r["throughput_tps"], 1), fmt(r["goodput_tps"], 1),
                         fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]), fmt(r["itl_p99_s"] * 1e3, 0),
                         r["preemptions"], f"{r['complete']}/{r['requests']}",
                         *(f"{place[m][p]} ({seed_rank[m].get(p, 'n/a')})" for m in ORDER),
                         fmt(r["sim_throughput_tps"], 1), fmt(r["sim_ttft_p99_s"]),
                         "yes" if r["disturbed"] else "no"])
            metrics.update({f"shaped.{workload}.k{k:g}.{p}.{m}": round(float(r[m]), 4)
                            for m in ("throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s", "itl_p99_s")
                            if r[m] is not None and r[m] == r[m]})
    md = markdown(["workload, burstiness", "policy", "rate, req/s", "throughput, tok/s", "goodput, tok/s",
                   "TTFT p50, s", "TTFT p99, s", "ITL p99, ms", "preemptions", "complete",
                   "place by throughput (seeds')", "place by TTFT p99 (seeds')", "simulated throughput, tok/s",
                   "simulated TTFT p99, s", "disturbed"], body)
    return md + ("\n\nMeasured on the engine (in-process replay) except the simulated columns; places: 1 is best "
                 "within the cell, the seeds' from the headline policies table. Rates in requests/s at the full-batch "
                 "step measured before the runs (the load multiple is what stays the same from machine to machine)."
                 ), metrics


def changes(result: dict, seeds: list[dict]) -> str:
    """Per measured cell: the leader by each metric against the seeds' leader, and every policy whose place moved
    by two or more, with its figure against the leader's."""
    seed_rank = {m: ranks(seeds, m) for m in ORDER}
    lines = []
    for rows in cells(result["measured"]).values():
        parts = []
        for m in ORDER:
            place, got = ranks(rows, m), {r["policy"]: r[m] for r in rows}
            lead = min(place, key=place.get)
            seed_lead = min(seed_rank[m], key=seed_rank[m].get) if seed_rank[m] else "n/a"
            moved = [f"{p} {seed_rank[m][p]} → {q}" + (f" ({fmt(got[p])} against {lead}'s {fmt(got[lead])})"
                                                        if p != lead else f" ({fmt(got[p])})")
                     for p, q in place.items() if p in seed_rank[m] and abs(q - seed_rank[m][p]) >= 2]
            parts.append(f"{NAMES[m]} led by {lead} (seeds: {seed_lead})"
                         + (f", moved two places or more: {', '.join(moved)}" if moved else ", no place moved by two"))
        lines.append(f"- {cell_name(rows[0])}: " + "; ".join(parts) + ".")
    return "What changed against the seeds (measured):\n\n" + "\n".join(lines)


def agreement_table(result: dict) -> tuple[str, dict]:
    """The simulator against the measured runs: over the runs not disturbed (the bar), and over every run with the
    disturbed ones in, labelled."""
    pairs = pd.DataFrame(result["measured"])
    body, metrics = [], {}
    for runs, st in (("not disturbed", agreement(pairs)),
                     ("all, disturbed included", agreement(pairs, disturbed_too=True))):
        body += [[NAMES[m], runs, fmt(v["spearman"]), fmt(v["spearman_within_cells_median"]),
                  "n/a" if v["runs"] == 0 else f"{v['median_rel_error']:.0%}", v["runs"]] for m, v in st.items()]
        tag = "" if runs == "not disturbed" else "with_disturbed."
        metrics.update({f"shaped.simulation.{tag}{m}.{k}": round(v[k], 4) for m, v in st.items() for k in v
                        if v[k] == v[k]})
    t = result["timing"]
    md = markdown(["metric", "measured runs", "Spearman, every run", "Spearman within a cell (median over cells)",
                   "median relative error", "runs"], body)
    return md + ("\n\nThe simulator replaying each measured run's own workload at its measured full-batch step, "
                 "against the measured figures. Stage time: "
                 f"{t['simulated_runs']} simulated runs in {t['simulated_s']:.0f} s, {t['measured_runs']} measured "
                 f"runs (each with its simulation) in {t['measured_s']:.0f} s."), metrics


def simulated_table(result: dict) -> str:
    """Every simulated cell at its load near capacity, each policy's throughput, goodput and TTFT p99."""
    measured = {(r["workload"], r["burstiness"]) for r in result["measured"]}
    body = [[cell_name(r), "yes" if (r["workload"], r["burstiness"]) in measured else "no", r["policy"],
             fmt(r["rate_rps"]), fmt(r["throughput_tps"], 1), fmt(r["goodput_tps"], 1), fmt(r["ttft_p50_s"]),
             fmt(r["ttft_p99_s"]), fmt(r["itl_p99_s"] * 1e3, 0), r["preemptions"]] for r in result["at_load"]]
    return markdown(["workload, burstiness", "also measured", "policy", "rate, req/s", "throughput, tok/s",
                     "goodput, tok/s", "TTFT p50, s", "TTFT p99, s", "ITL p99, ms", "preemptions"], body) + (
        f"\n\nAll simulated (the cost model on the real scheduler), {len(result['at_load'])} runs at each workload's "
        "load near capacity, at the full-batch step the cost model predicts.")


def capacity_table(result: dict) -> tuple[str, dict]:
    """Capacity at the SLO (req/s) per shape, k and policy; a measured run at that cell marked with its rate and
    whether it met the SLO."""
    measured = {(r["workload"], r["burstiness"], r["policy"]): r for r in result["measured"]}
    caps = result["capacities"]
    pols = list(dict.fromkeys(c["policy"] for c in caps))
    body, metrics = [], {}
    for key, rows in cells(caps).items():
        got = {c["policy"]: c for c in rows}
        row = [cell_name(rows[0])]
        for p in pols:
            c, m = got[p], measured.get((*key, p))
            mark = f" [measured at {m['rate_rps']:.2f}: {'met' if meets(m) else 'missed'}]" if m else ""
            row.append(f"{c['capacity_rps']:.2f}{mark}")
            metrics[f"shaped.capacity.{key[0]}.k{key[1]:g}.{p}"] = round(c["capacity_rps"], 4)
        body.append(row)
    limits = caps[0]
    return markdown(["workload, burstiness", *(f"{p}, req/s" for p in pols)], body) + (
        f"\n\nCapacity at the SLO: the largest simulated rate whose TTFT p99 ≤ {limits['ttft_limit_s']:.2f} s and "
        f"TPOT p50 ≤ {limits['tpot_limit_s'] * 1e3:.0f} ms (conf/slo, at the predicted full-batch step), over load "
        f"multiples {', '.join(f'{m:g}' for m in sorted({r['multiple'] for r in result['sweep']}))} of the "
        "full-batch decode capacity; 0.00: met at none. Simulated; the bracketed runs measured on the engine "
        "(judged at their own measured step)."), metrics


def meets(r: dict) -> bool:
    """A measured run meets its own limits."""
    return meets_limits(r, r["ttft_limit_s"], r["tpot_limit_s"])


def capacity_line(result: dict) -> str:
    """The SLO picker's line on shaped traffic: each shape's best policy and its capacity at the SLO at k = 1."""
    best = {}
    for c in result["capacities"]:
        if c["burstiness"] == 1.0 and c["capacity_rps"] > best.get(c["lengths"], {"capacity_rps": -1})["capacity_rps"]:
            best[c["lengths"]] = c
    return ("- **Capacity at the SLO on production-shaped traffic** (k = 1, simulated, validated in the "
            "production-shaped section): " + "; ".join(f"{name}: {c['capacity_rps']:.2f} req/s by {c['policy']}"
                                                       for name, c in best.items()) + ".")


def render(result: dict, seeds: list[dict]) -> list[tuple[str, str, str, dict]]:
    """(title, note, body, metrics) of each section."""
    table, m1 = measured_table(result, seeds)
    agree, m2 = agreement_table(result)
    caps, m3 = capacity_table(result)
    loads = ", ".join(f"{result['lengths'][w]}: {m:g}" for w, m in result["loads"].items())
    note = (f"Every policy at one load near capacity per workload ({result['near']:g} x the simulated capacity at "
            f"the SLO of {result['reference']} at k = 1, as a multiple of the full-batch decode capacity: {loads}); "
            "gamma arrivals of burstiness k (CV 1/√k; k = 1 is Poisson), the same workload and arrivals for every "
            "policy of a cell. Lengths scaled down to fit this CPU, as each workload's name says.")
    return [("Do the policies' leads survive production shapes?", note,
             table + "\n\n" + changes(result, seeds), m1),
            ("Simulator against the production-shaped runs", "", agree, m2),
            ("Production shapes, the rest of the grid (simulated)", "", simulated_table(result), {}),
            ("Capacity at the SLO on production-shaped traffic (simulated)", "", caps, m3)]
