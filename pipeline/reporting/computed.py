"""The computed reports: one GPU's seed tables (reports/hardware/<name>/REPORT.md and its plots) and the validation of
the method against published runs (reports/gpu_validation.md). Every table and axis says computed."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from pipeline.reporting.plots import throughput_vs_ttft  # noqa: E402
from pipeline.reporting.tables import fmt, markdown  # noqa: E402
from pipeline.results import write_figure  # noqa: E402

NOTE = ("Every figure here is **computed**, not measured: the lab's own scheduler on a virtual clock whose steps cost "
        "what the spec sheet's roofline says (pipeline/modeling/roofline.py).")


def inputs(c: dict, validation: dict | None) -> str:
    hw, eff = c["hardware"], c["hardware"]["efficiency"]
    rates = ", ".join(f"{k} {v:g} TFLOP/s" for k, v in hw["tflops"].items())
    cal = "; ".join(f"{k} on `{v}`" for k, v in (eff.get("calibrated_from") or {}).items() if v)
    own = (eff.get("calibrated_from") or {}).get("bandwidth")
    line = (f"Inputs: `conf/hardware/{hw['name']}.yaml` ({hw['label']}: {hw['memory_gb']:g} GB, "
            f"{hw['bandwidth_gbs']:g} GB/s, dense {rates}; sources in the file), model `{c['item']['model']}` at "
            f"`{c['item']['precision']}`; efficiency: {eff['bandwidth']:.0%} of the bandwidth, {eff['matrix']:.0%} of "
            f"the matrix rate, {eff['step_s'] * 1e3:g} ms a step, "
            + f"each solved on one published run (data/published/gpu_runs.yaml): {cal}."
            + ("" if own else " Its bandwidth share is **not calibrated** on a run of its own: none of a known shape "
               "at 16 bits was found; it takes the calibrated GPUs' median."))
    if validation:
        st = validation["stats"]
        line += (f" The method's error against {st['figures']} published runs from {st['sources']} sources: median "
                 f"{st['median_abs_rel_error']:.1%}, largest {st['max_abs_rel_error']:.1%} "
                 "([gpu_validation.md](../../gpu_validation.md)).")
    return line


def step_section(rows: list[dict]) -> str:
    body = [[r["batch"], fmt(r["weights_gb"]), fmt(r["kv_gb"], 3), f"{r['kv_share']:.0%}",
             fmt(r["ideal_step_s"] * 1e3, 1), fmt(r["ideal_user_tps"], 1), fmt(r["ideal_total_tps"], 0),
             fmt(r["step_s"] * 1e3, 1), fmt(r["user_tps"], 1), fmt(r["total_tps"], 0), r["bound"]] for r in rows]
    return markdown(["B", "weights, GB", "K/V, GB", "K/V share of traffic", "step at the spec sheet, ms",
                     "per user, tok/s", "total, tok/s", "step calibrated, ms", "per user, tok/s", "total, tok/s",
                     "largest part"], body) + (
        f"\n\nComputed at {rows[0]['context']} tokens of context per user. The first three step columns are seed "
        "000's arithmetic, (weights + B x K/V) / bandwidth at efficiency 1; the last four the calibrated roofline "
        "of every operator (weights, K/V, LM head, attention FLOPs, fixed cost per step).")


def seats_section(rows: list[dict]) -> str:
    body = [[r["hardware"], r["model"], r["devices"], fmt(r["weights_gb"], 1), fmt(r["kv_gb"], 1),
             fmt(r["kv_kib_per_token"], 0), f"{r['kv_tokens']:,}", r["seats_1024"], r["seats_4096"]] for r in rows]
    return markdown(["hardware", "model", "devices", "weights, GB", "K/V room, GB", "K/V per token, KiB",
                     "tokens that fit", "seats at 1K", "seats at 4K"], body) + (
        "\n\nComputed: 90 % of each device's memory less the weights holds K/V (vLLM's default memory share); a "
        "model whose weights do not fit one device is split over the fewest that hold it.")


def runs_section(rows: list[dict], first: str, key) -> str:
    body = [[key(r), fmt(r["throughput_tps"], 0), fmt(r["goodput_tps"], 0), fmt(r["ttft_p50_s"], 3),
             fmt(r["ttft_p99_s"], 3), fmt(r["tpot_p50_s"] * 1e3, 1), fmt(r["itl_p99_s"] * 1e3, 1),
             fmt(r.get("slot_efficiency"))] for r in rows]
    return markdown([first, "throughput, tok/s", "goodput, tok/s", "TTFT p50, s", "TTFT p99, s", "TPOT p50, ms",
                     "ITL p99, ms", "slot efficiency"], body) + "\n\nAll computed."


def production_section(p: dict) -> str:
    body = [[r["lengths"], r["policy"], fmt(r["multiple"]), fmt(r["rate_rps"], 2), fmt(r["throughput_tps"], 0),
             fmt(r["ttft_p99_s"], 3), fmt(r["tpot_p50_s"] * 1e3, 1), r["clipped"]] for r in p["rows"]]
    return markdown(["shape", "policy", "load (x decode capacity)", "rate, req/s", "throughput, tok/s",
                     "TTFT p99, s", "TPOT p50, ms", "clipped"], body) + (
        "\n\nComputed, gamma arrivals of burstiness k = 0.25 (bursty); lengths as published (no scale divisor), "
        "clipped to the context where longer; each policy at the rows it is deployed with ("
        + ", ".join(f"{k} {v}" for k, v in p["deployed"].items()) + "), the same arrivals for each.")


def picker_section(p: dict, tp: int) -> str:
    body = [[c["workload"], c["policy"], fmt(c["capacity_rps"], 2), fmt(c["capacity_rps_per_device"], 2),
             fmt(c["output_tps_at_capacity"], 0)] for c in p["capacities"]]
    return markdown(["shape", "policy", "capacity at the SLO, req/s", f"per GPU ({tp} in all)",
                     "output tok/s there"], body) + (
        f"\n\nComputed: the highest simulated rate whose TTFT p99 <= {p['ttft_limit_s']:g} s and TPOT p50 <= "
        f"{p['tpot_limit_s'] * 1e3:g} ms (conf/slo/chat); 0 where no rate tried meets it.")


def step_plot(rows: list[dict], title: str, path) -> None:
    df = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(df["batch"], df["ideal_total_tps"], marker="o", label="total, spec sheet (seed 000's arithmetic)")
    ax.plot(df["batch"], df["total_tps"], marker="o", label="total, calibrated roofline")
    ax.plot(df["batch"], df["user_tps"], marker="s", linestyle="--", label="per user, calibrated roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B (decode rows at 1K context)")
    ax.set_ylabel("tok/s (computed)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig, 120)
    plt.close(fig)


def report(c: dict, validation: dict | None, plots) -> str:
    """REPORT.md of one computed entry; its plots drawn into `plots`."""
    plots.mkdir(parents=True, exist_ok=True)
    name = f"{c['item']['model']} at {c['item']['precision']} on {c['hardware']['label']}"
    step_plot(c["step_table"], f"Decode step at 1K context: {name} (computed)", plots / "step_time.png")
    points = pd.DataFrame([{"series": r["series"], "label": f"c={r['concurrency']}", "ttft_p99_s": r["ttft_p99_s"],
                            "throughput_tps": r["throughput_tps"], "samples": r["complete"], "disturbed": False}
                           for r in c["closed_loop"]])
    title = f"Closed loop, {c['closed_tokens']} tokens each: {name} (computed)"
    throughput_vs_ttft(points, c["production"]["ttft_limit_s"], title, plots / "throughput_vs_ttft.png")
    parts = [f"# Computed: {name}", NOTE, inputs(c, validation),
             f"Seed 003's tables at {c['seats']} seats for every policy; loads in units of {c['seats']} rows decoding "
             f"(a full-batch step of {c['full_batch_step_s'] * 1e3:.2f} ms); paged K/V for iteration-level policies "
             f"({c['kv_tokens']:,.0f} tokens fit); a request up to {c['context_tokens']} tokens; profile `gpu`"
             + (f", every run's requests x {c['item']['requests_scale']:g} (the entry's `requests_scale`)."
                if float(c["item"].get("requests_scale", 1)) != 1 else "."),
             "## Step time against batch size (seed 000, computed)", step_section(c["step_table"]),
             "![step time](plots/step_time.png)",
             "## Seats: requests that fit (seed 000, computed)", seats_section(c["seats_table"]),
             "## Every policy (seed 003, computed)",
             runs_section(c["all_policies"], "policy", lambda r: r["policy"]),
             "## Dynamic timeouts (seed 003, computed)",
             runs_section(c["dynamic_timeouts"], "run", lambda r: r["run"]),
             "## Chunked budgets: prefill stalls decode (seed 003, computed)",
             runs_section(c["prefill_stall"], "run", lambda r: r["run"]),
             "## Load sweep (seed 003, computed)",
             runs_section(c["load_sweep"], "policy, load", lambda r: f"{r['policy']}, {r['load_multiple']:g}x"),
             "## Throughput against TTFT p99 under closed-loop load (seed 000, computed)",
             runs_section(c["closed_loop"], "server, users", lambda r: f"{r['series']}, c={r['concurrency']}"),
             "![throughput against TTFT p99](plots/throughput_vs_ttft.png)",
             "## Production shapes at their published lengths (computed)", production_section(c["production"]),
             "## The SLO picker: capacity per GPU at the SLO (computed)",
             picker_section(c["production"], int(c["hardware"].get("tp", 1)))]
    return "\n\n".join(parts) + "\n"


def validation_report(v: dict) -> str:
    st = v["stats"]

    def mark(r: dict) -> str:
        return " (calibration)" if r["calibration"] else (f" (not counted: {r['excluded']})" if r["excluded"] else "")
    body = [[r["id"], r["engine"] + (" (decode K/V read once per query head)" if r["kv_per_query_head"] else ""),
             r["published_model"], r["batch"], r["input_tokens"], r["output_tokens"],
             r["metric"], f"{r['published']:.4g}", f"{r['computed']:.4g}", f"{r['rel_error']:+.1%}" + mark(r)]
            for r in v["figures"]]
    eff = [[h, e["label"], fmt(e["efficiency"]["bandwidth"]), fmt(e["efficiency"]["matrix"]),
            fmt(e["efficiency"]["step_s"] * 1e3, 2),
            "; ".join(f"{k}: {run}" for k, run in (e["efficiency"].get("calibrated_from") or {}).items())]
           for h, e in v["hardware"].items()]
    return "\n\n".join([
        "# Computed step times against published GPU runs",
        "Each published run (data/published/gpu_runs.yaml: source, engine and version, GPU, model, shapes) computed "
        "by the lab's scheduler on a virtual clock at its GPU's spec sheet (conf/hardware/), in its model's exact "
        "shape, at 16-bit weights and K/V; where the engine's decode attention loads a K/V head once for each query "
        "head it serves (TensorRT-LLM before its XQA kernel, v0.8), its decode rows read that many times their K/V. "
        "The computed column is computed; the published one is the source's measurement.",
        f"**{st['figures']} runs from {st['sources']} sources, calibration runs and excluded runs not counted: median "
        f"|relative error| {st['median_abs_rel_error']:.1%}, largest {st['max_abs_rel_error']:.1%}, "
        f"{st['over_35_percent']} above 35 %.** Of them {st['figures_from_sources_not_calibrating']} come from "
        f"{st['sources_not_calibrating']} sources that calibrated nothing. {st['calibration_figures']} calibration "
        "runs are listed and marked: each GPU's bandwidth share solved on a run of its own, the matrix share and the "
        "fixed cost a step (one each, shared by every GPU) on two A100 runs; "
        f"{st['excluded_figures']} runs are computed but not counted, each with its reason.",
        markdown(["GPU", "spec sheet", "bandwidth share", "matrix share", "fixed ms a step", "calibrated on"], eff),
        markdown(["run", "engine", "model", "batch", "input", "output", "metric", "published", "computed",
                  "error"], body)]) + "\n"


def pointer(reports) -> tuple[str, str, dict]:
    """The CPU report's separate section on the computed reports: (what they are and the method's error, links to
    them, metrics with keys under `computed.`, never beside a measured one)."""
    path = reports / "gpu_validation.json"
    if not path.exists():
        return "", "", {}
    st = json.loads(path.read_text())["stats"]
    done = sorted(p.parent.name for p in (reports / "hardware").glob("*/REPORT.md"))
    lines = [f"- [{name}](hardware/{name}/REPORT.md)" for name in done]
    if (reports / "fleet" / "FLEET.md").exists():
        lines.append("- [fleets](fleet/FLEET.md): routers, prefill and decode apart, the fewest GPUs for a rate "
                     "(`python -m pipeline.tools.fleet`, `python -m pipeline.tools.plan`)")
    text = ("Nothing in this section is measured. The seed tables at GPU scale are computed by the same scheduler on a "
            f"virtual clock whose steps cost what a spec sheet's roofline says (conf/hardware/, "
            f"pipeline/modeling/roofline.py); checked against {st['figures']} published GPU runs from {st['sources']} "
            f"sources, median |relative error| {st['median_abs_rel_error']:.1%}, largest "
            f"{st['max_abs_rel_error']:.1%} ([gpu_validation.md](gpu_validation.md)). One computed report per "
            "`computed` entry of params (`python -m pipeline.tools.steptime` asks one step or batch):")
    metrics = {"computed.gpu_validation.median_abs_rel_error": round(st["median_abs_rel_error"], 4),
               "computed.gpu_validation.max_abs_rel_error": round(st["max_abs_rel_error"], 4)}
    return text, "\n".join(lines), metrics
