"""Throughput against TTFT p99 (seed 000's chart, PNG plus CSV for `dvc plots`) and the seed tables' pictures (PNG)."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from pipeline.results import write_figure, write_text  # noqa: E402


def load_rows(folder) -> pd.DataFrame:
    """Summary rows of every results JSON in a folder (data/results/engine or .../server)."""
    rows = [r for p in sorted(folder.glob("*.json")) for r in json.loads(p.read_text())["rows"]]
    return pd.DataFrame(rows)


def throughput_vs_ttft(points: pd.DataFrame, slo_s: float, title: str, path):
    """One line per series; x TTFT p99 (log), y throughput; points labelled; * where fewer than 100 samples, !
    where the run was disturbed by other work on the machine."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for series, g in points.groupby("series", sort=False):
        g = g.sort_values("ttft_p99_s")
        ax.plot(g["ttft_p99_s"], g["throughput_tps"], marker="o", label=series)
        for r in g.itertuples():
            mark = ("" if r.samples >= 100 else "*") + ("!" if r.disturbed else "")
            ax.annotate(f"{r.label}{mark}", (r.ttft_p99_s, r.throughput_tps),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.axvline(slo_s, linestyle="--", linewidth=1, color="grey")
    ax.text(slo_s * 1.05, ax.get_ylim()[1] * 0.95, f"SLO: TTFT {slo_s:.2f} s", fontsize=8)
    ax.set_xlabel("TTFT p99 (s, log scale)   * = fewer than 100 samples   ! = disturbed run")
    ax.set_ylabel("throughput, all users (tok/s)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_figure(path, fig, 120)
    plt.close(fig)
    write_text(path.with_suffix(".csv"), points.to_csv(index=False))


def engine_points(rows: pd.DataFrame) -> pd.DataFrame:
    """Engine runs as chart points: each policy (with its knob) a series, each load a point."""
    t = rows[rows["table"].isin(["dynamic_timeouts", "all_policies"])].copy()
    t["series"] = t["policy"] + t["max_wait_ms"].map(lambda w: "" if pd.isna(w) else f" wait {w:g} ms") \
        if "max_wait_ms" in t else t["policy"]
    t["label"] = t["load_multiple"].map(lambda m: f"{m:g}x")
    t["samples"] = t["complete"]
    t["disturbed"] = t["disturbed"].fillna(False).astype(bool) if "disturbed" in t else False
    return t[["series", "label", "ttft_p99_s", "throughput_tps", "samples", "disturbed"]]


def draw_all(results, plots):
    """Every chart of the results under `results` (data/results) into `plots` (reports/plots)."""
    plots.mkdir(parents=True, exist_ok=True)
    engine = load_rows(results / "engine")
    if len(engine):
        throughput_vs_ttft(engine_points(engine), float(engine["ttft_limit_s"].median()),
                           "Engine replay: policies and loads (measured)",
                           plots / "engine_throughput_vs_ttft.png")
    server = load_rows(results / "server")
    if len(server):
        pts = server.assign(series=server["backend"], label=server["concurrency"].map(lambda c: f"c={c}"),
                            samples=server["complete"],
                            disturbed=(server["disturbed"].fillna(False).astype(bool) if "disturbed" in server
                                       else False))
        throughput_vs_ttft(pts[["series", "label", "ttft_p99_s", "throughput_tps", "samples", "disturbed"]],
                           float(server["ttft_limit_s"].median()),
                           "Servers under closed-loop load (measured)", plots / "throughput_vs_ttft.png")
    sim_path = results / "simulation.json"
    if sim_path.exists():
        simulation_plots(json.loads(sim_path.read_text()), plots)
    if len(engine):
        kv_plots(engine, plots)
    stall = engine[engine["table"] == "prefill_stall"] if len(engine) else engine
    if len(stall):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        names = [p if p != "chunked" else f"chunked {int(b)}"
                 for p, b in zip(stall["policy"], stall.get("token_budget", [0] * len(stall)))]
        ax.bar(names, stall["itl_p99_s"] * 1e3, label="ITL p99")
        ax.plot(names, stall["itl_max_s"] * 1e3, "k^", label="ITL max")
        ax.set_ylabel("ms")
        ax.set_title("Prefill stalls decode: inter-token latency (measured)", fontsize=10)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
        ax.legend(fontsize=7)
        fig.tight_layout()
        write_figure(plots / "prefill_stall.png", fig, 120)
        plt.close(fig)


def kv_plots(engine: pd.DataFrame, plots):
    """kv_memory: TTFT p99 and peak running requests against load, slot against paged; shared_prefix: TTFT p50
    against the shared prefix's length, with and without the prefix cache."""
    kv = engine[engine["table"] == "kv_memory"]
    if len(kv):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        for name, g in kv.groupby("kv", sort=False):
            a.plot(g["load_multiple"], g["ttft_p99_s"], marker="o", label=name)
            b.plot(g["load_multiple"], g["peak_running"], marker="o", label=name)
        a.set_xlabel("load (x capacity)"), a.set_ylabel("TTFT p99, s"), a.set_yscale("log")
        b.set_xlabel("load (x capacity)"), b.set_ylabel("peak running requests")
        a.legend(fontsize=7)
        fig.suptitle("One KV memory budget: slot seats against paged blocks (measured)", fontsize=10)
        fig.tight_layout()
        write_figure(plots / "kv_memory.png", fig, 110)
        plt.close(fig)
    sp = engine[engine["table"] == "shared_prefix"]
    if len(sp):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for (cached, n), g in sp.groupby(["prefix_caching", "requests"], sort=False):
            g = g.sort_values("shared_prefix_tokens")
            ax.plot(g["shared_prefix_tokens"], g["ttft_p50_s"], marker="o",
                    label=f"{'prefix cache' if cached else 'no cache'}, {n} requests")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shared prefix, tokens"), ax.set_ylabel("TTFT p50, s")
        ax.set_title("Prefix caching: TTFT against the shared prefix (measured)", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        write_figure(plots / "shared_prefix.png", fig, 110)
        plt.close(fig)


def simulation_plots(sim: dict, plots):
    val = pd.DataFrame(sim["validation"])
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, m, name in zip(axes, ["throughput_tps", "ttft_p50_s", "tpot_p50_s"], ["throughput, tok/s", "TTFT p50, s",
                                                                                     "TPOT p50, s"]):
        ax.scatter(val[f"real_{m}"], val[f"sim_{m}"], s=12)
        lim = [0, max(val[f"real_{m}"].max(), val[f"sim_{m}"].max()) * 1.05]
        ax.plot(lim, lim, "k--", linewidth=0.8)
        ax.set_xlabel(f"real {name}")
        ax.set_ylabel(f"simulated {name}")
    fig.suptitle("Simulator against real runs", fontsize=10)
    fig.tight_layout()
    write_figure(plots / "simulator_validation.png", fig, 110)
    plt.close(fig)
    sw = pd.DataFrame([r for r in sim["sweeps"] if r["axis"] == "load.multiple"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p, g in sw.groupby("policy", sort=False):
        a.plot(g["value"], g["throughput_tps"], marker="o", label=p)
        b.plot(g["value"], g["goodput_tps"], marker="o", label=p)
    a.set_xlabel("load (x capacity)"), a.set_ylabel("throughput, tok/s"), b.set_xlabel("load (x capacity)")
    b.set_ylabel("goodput, tok/s")
    a.legend(fontsize=7)
    fig.suptitle("Load sweep, simulated (median of 3 seeds)", fontsize=10)
    fig.tight_layout()
    write_figure(plots / "load_sweep.png", fig, 110)
    plt.close(fig)
