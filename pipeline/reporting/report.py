"""REPORT.md and metrics.json from a repository's results (data/results/, reports/): every section from its results
file, each file checked to come from this machine (reports/machine.json) or labelled (report.other_machine)."""
import json
from pathlib import Path

from pipeline.config import group_entry
from pipeline.measuring.metrics import meets_slo
from pipeline.reporting import computed, fleet_measured, models, precision_table, shaped, speculation, tables
from pipeline.workloads.runs import table_config


class MixedMachines(SystemExit):
    """Figures of two machines would meet in one report."""


class Inputs:
    """Reads the report's inputs and checks that each was measured on this machine (reports/machine.json).

    A file named in `other_machine` (config report.other_machine) may come from another machine; its section then
    says whose figures they are. Any other mismatch stops the report with an error naming both machines."""

    def __init__(self, root: Path, machine: dict, other_machine=()):
        self.root, self.machine, self.other = root, machine, set(other_machine)
        self.foreign: dict[str, dict] = {}  # file name -> the other machine it was measured on

    def read(self, path):
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        theirs = data.get("machine") if isinstance(data, dict) else None
        if theirs is None or theirs["id"] != self.machine["id"]:
            name = self.name(path)
            what = f"machine {theirs['id']} ({theirs['label']})" if theirs else "an unrecorded machine"
            if name not in self.other:
                raise MixedMachines(
                    f"report: {name} was measured on {what}, but this machine is {self.machine['id']} "
                    f"({self.machine['label']}). Rerun its stage here (dvc repro), or list it under "
                    f"report.other_machine to show it labelled as the other machine's.")
            self.foreign[name] = theirs or {"id": "unknown", "label": "an unrecorded machine"}
        return data

    def name(self, path) -> str:
        """A results file as the config names it: relative to the repository."""
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def note(self, path) -> str:
        """'' for this machine's file, else a sentence saying whose figures these are."""
        theirs = self.foreign.get(self.name(path))
        return f" **Measured on another machine: {theirs['label']} ({theirs['id']}), not this one.**" if theirs else ""


def engine_tables(inputs: Inputs, results: Path) -> dict[str, list[dict]]:
    return {p.stem: inputs.read(p)["rows"] for p in sorted((results / "engine").glob("*.json"))}


def section(title: str, note: str, body: str) -> str:
    return f"## {title}\n\n{note}\n\n{body}\n"


def engine_speed_section(rows: list[dict], prec: dict | None) -> tuple[str, dict]:
    f = tables.fmt
    body = tables.markdown(
        ["precision", "accuracy against fp32", "B", "prompt tokens", "new tokens", "engine tok/s", "HF tok/s", "ratio",
         "engine prefill, s", "HF prefill, s", "engine decode tok/s", "HF decode tok/s", "decode ratio",
         "engine weights, MB", "KV cache, MB", "peak, MB", "paged/slot decode", "decode / floor",
         "decode / bytes floor", "same, bandwidth read here", "other CPUs", "disturbed"],
        [[r.get("precision", "fp32"), tables.accuracy_of(prec, r.get("precision", "fp32")), r["batch"],
          r["prompt_tokens"], r["new_tokens"], f(r["engine_tps"], 1), f(r["hf_tps"], 1), f(r["ratio"]),
          f(r["engine_prefill_s"]), f(r["hf_prefill_s"]), f(r["engine_decode_tps"], 1), f(r["hf_decode_tps"], 1),
          f(r["decode_ratio"]), f(r["engine_weight_bytes"] / 1e6, 0), f(r["kv_cache_bytes"] / 1e6, 0),
          f(r["engine_peak_mb"], 0), f(r.get("paged_decode_ratio")), f(r.get("floor_fraction")),
          f(r.get("bytes_fraction")), f(r.get("bytes_fraction_here")), f(r.get("other_cpu_share")),
          "yes" if r.get("disturbed") else "no"]
         for r in rows])
    metrics = {f"engine_speed.{r.get('precision', 'fp32')}.b{r['batch']}_p{r['prompt_tokens']}.{k}": round(r[k], 3)
               for r in rows for k in ("engine_tps", "hf_tps", "ratio", "decode_ratio", "engine_decode_tps",
                                       "paged_decode_ratio", "floor_fraction", "bytes_fraction",
                                       "bytes_fraction_here") if k in r}
    return body, metrics


def machine_dependence(hw: dict | None) -> str:
    """Why these speeds belong to this machine, from its probe: where a decode step sits on the roofline."""
    if not hw:
        return ""
    one = hw["floors"][0]
    knee = next((f["batch"] for f in hw["floors"] if f["regime"] == "compute-bound"), None)
    return (f" These figures depend on the CPU: its probe measured {hw['bandwidth_gbs']:.1f} GB/s streaming read "
            f"and {hw['gflops']['fp32']:.0f} GFLOP/s fp32 products, so one decode step's matrix products take "
            f"{one['measured_ms']:.1f} ms at B=1 (the weights read once) and the step turns compute-bound near "
            f"B = {knee} (HARDWARE.md); a CPU with twice the bandwidth or wider vector units moves both.")


def capacity_answer(rows: list[dict], hw: dict | None, share: float, shaped_result: dict | None = None) -> str:
    """Seed 000's question: capacity at the SLO (met by `share` of a run's requests), on production-shaped traffic
    too where data/results/shaped.json is there, the batch size to pick, and what stops a bigger batch."""
    ok = [r for r in rows if meets_slo(r, share)]
    lines = []
    if ok:
        best = max(ok, key=lambda r: r["throughput_tps"])
        lines.append(f"- **Capacity at the SLO** ({share:.0%} of requests within TTFT ≤ {best['ttft_limit_s']:.2f} "
                     f"s and TPOT ≤ {best['tpot_limit_s'] * 1e3:.0f} ms): {best['throughput_tps']:.1f} tok/s, by "
                     f"`{best['point']}` in table {best['table']} (measured).")
    else:
        lines.append("- **Capacity at the SLO**: no run met the SLO.")
    if shaped_result:
        lines.append(shaped.capacity_line(shaped_result))
    if hw:
        ridge = hw["ridge_flop_per_byte"]
        knee = next((f["batch"] for f in hw["floors"] if f["regime"] == "compute-bound"), None)
        seats = hw["seats"][0]
        one = hw["floors"][0]["measured_ms"]
        free = max(f["batch"] for f in hw["floors"] if f["measured_ms"] <= 1.5 * one)
        lines.append(f"- **Batch size to pick**: by the roofline the step stays memory-bound (batching almost free) "
                     f"while FLOP per weight byte is below the ridge, {ridge:.1f}, which ends near B = {knee} "
                     f"(computed); measured, the step is within 1.5x of the B=1 step only up to B = {free}, because "
                     "small matrix products run below peak on this CPU. Past that each row costs step time, so pick "
                     "the largest batch whose step still meets the TPOT limit.")
        lines.append(f"- **What stops you**: memory space allows {seats['seats_that_fit']} seats at "
                     f"{seats['context']} tokens of context (computed); raw math ("
                     f"{hw['gflops'][hw.get('compute', 'fp32')]:.0f} GFLOP/s) stops a bigger "
                     f"batch first here because the ridge is low; on a GPU memory speed and then memory space do.")
    return "\n".join(lines)


def static_fill_wait(sim: dict, cfg) -> str:
    """Seed 003's open question: why static's TTFT p99 rises as load falls. A batch waits for max_batch arrivals."""
    rows = {r["value"]: r for r in sim["sweeps"] if r["axis"] == "load.multiple" and r["policy"] == "static"}
    lo, nxt = sorted(rows)[:2]
    swept = table_config(cfg, "all_policies")  # the sweeps' own workload and load (pipeline.modeling.simulation)
    mean_out = swept.workload.output.mean * cfg.profile.output_scale
    rate = lo * swept.load.ref_seats / mean_out / sim["step_s"]  # requests per second at the lightest load
    batch = group_entry("policy", "static")["max_batch"]
    fill = (batch - 1) / rate
    return (f"Static's TTFT p99 is {rows[lo]['ttft_p99_s']:.1f} s at load {lo:g} "
            f"against {rows[nxt]['ttft_p99_s']:.1f} s "
            f"at {nxt:g} (simulated): a static batch launches only when {batch} requests "
            f"have arrived, and at load {lo:g} the first of them waits {fill:.1f} s on average for the other "
            f"{batch - 1} (computed: (max_batch - 1) / arrival rate). The lighter the load, "
            "the longer the wait: the direction is right, not an artefact.")


def disturbance(runs: dict[str, list[dict]]) -> tuple[str, dict]:
    """The header's account of the timed runs (group of runs -> its rows, each with `disturbed` and `tries`): how
    many were measured more than once, how many are still disturbed (kept and marked)."""
    rows = [r for group in runs.values() for r in group if "disturbed" in r]
    again = sum(1 for r in rows if r.get("tries", 1) > 1)
    still = [f"{name}: {r.get('point') or r.get('backend') or r.get('batch')}" + (
        f" c={r['concurrency']}" if "concurrency" in r else "") for name, group in runs.items() for r in group
        if r.get("disturbed")]
    text = (f"Timed runs: {len(rows)}; {again} were disturbed by other work on the machine and measured again; "
            f"{len(still)} stayed disturbed after every try and are kept, marked as such"
            + (": " + ", ".join(still) if still else "") + ".")
    return text, {"measurement.runs": len(rows), "measurement.remeasured_runs": again,
                  "measurement.disturbed_runs": len(still)}


def marked(rows: list[dict]) -> str:
    """A section's sentence naming its disturbed runs, if any."""
    bad = [r.get("point", "") for r in rows if r.get("disturbed")]
    return f" **Disturbed (kept after every try; less reliable): {', '.join(bad)}.**" if bad else ""


def build(cfg, root: Path) -> tuple[str, dict]:
    """(REPORT.md's text, metrics.json's figures) from the results under `root`."""
    results, reports = root / "data" / "results", root / "reports"
    machine = json.loads((reports / "machine.json").read_text())
    inputs = Inputs(root, machine, cfg.report.other_machine)
    read = inputs.read
    parts, metrics = [], {}
    hw = read(reports / "hardware.json")
    eq = read(reports / "equivalence.json")
    if eq:
        rule = eq.get("rule", "token-equal")
        parts.append(section("Correctness", f"Seed 000's scenario (six requests, three seats, staggered arrivals) at "
                             f"precision {eq.get('precision', 'fp32')}: requests whose tokens equal Hugging Face "
                             "`generate` run alone, per policy (measured)" + (
                                 "" if rule == "token-equal" else ", or diverge from them only at a near-tie of "
                                 f"generate's own logits (within {eq['near_tie']:g})") + "."
                             + inputs.note(reports / "equivalence.json"),
                             tables.markdown(["policy", rule],
                                             [[p, f"{n}/{eq['requests']}"] for p, n in eq["matches"].items()])))
        metrics.update({f"equivalence.{p}": n / eq["requests"] for p, n in eq["matches"].items()})
    prec = read(reports / "precision.json")
    if prec:
        body, m = tables.precision(prec)
        parts.append(section("Precision: what each level costs in accuracy", "Each level's logits against fp32's, "
                             "teacher-forced on a token stream of distinct prompts of the project continued greedily "
                             f"by fp32 ({prec['positions']} positions; "
                             f"{prec.get('stream', 'continued by fp32 on this machine')}), in fp64: KL divergence, "
                             "top-1 agreement (and without "
                             f"near-ties: the reference's top two within {prec['near_tie']:g} in log-probability), "
                             "perplexity change; free-running, whole greedy requests equal to fp32's. The noise floor "
                             "first: fp32 against itself through another product (and free-running, one request at a "
                             f"time against all at once); lossless = within {prec['lossless_kld']:g}x the floor's KLD "
                             f"and {prec['lossless_top1']:.1%} top-1 without near-ties (measured)."
                             + inputs.note(reports / "precision.json"), body))
        metrics.update(m)
    speed = read(reports / "engine_speed.json")
    if speed:
        body, m = engine_speed_section(speed["rows"], prec)
        parts.append(section("Engine against Hugging Face generate", "Same model, dtype and requests in one "
                             "process; B requests at once, exact new tokens "
                             "(`python -m pipeline.stages.engine_speed`). "
                             "decode / floor: the engine's decode rate against its matrix products alone, run "
                             "for as many steps right after each engine run (the fastest such run); decode / bytes "
                             "floor: against every weight byte read once a step at the probe's read bandwidth "
                             "(the bound at small batches); same, bandwidth read here: against that floor at the "
                             "bandwidth read again in the engine's process just before the case."
                             + inputs.note(reports / "engine_speed.json") + machine_dependence(hw), body))
        metrics.update(m)
    results_by_table = engine_tables(inputs, results)
    notes = {
        "static_efficiency": ("Static batching's zombie rows (seed 003 §1)", "8 seats, saturated arrivals."),
        "dynamic_timeouts": ("Dynamic batching: timeouts at light and saturating load (seed 003 §2)",
                             "Load as a multiple of the measured full-batch decode capacity."),
        "all_policies": ("All policies on the headline workload (seed 003 §4, §6; the §2 length oracle)",
                         "Same arrivals for every policy. `bucketed` is an oracle: it reads each request's true "
                         "output length."),
        "prefill_stall": ("Prefill stalls decode (seed 003 §5)", "15% long prompts."),
        "precision_policies": ("Precision as an axis: the headline policies at each precision level",
                               "The all_policies workload and arrivals at each level, each level's load and SLOs in "
                               "units of its own measured full-batch step; each level's accuracy against fp32 from "
                               "reports/precision.json."),
        "kv_memory": ("One KV memory budget: slot seats against a paged pool (seed 003 §7, measured)",
                      "The slot cache reserves 8 worst-case seats; the paged pool holds the same bytes in blocks "
                      "taken as tokens arrive, with up to 64 requests running and recompute preemption."),
        "shared_prefix": ("Prefix caching: requests sharing a system preamble",
                          "Closed loop, 4 in flight, paged KV with and without prefix caching; the expectation is "
                          "computed from the prompts (the first 4 are admitted together and find nothing)."),
        "preemption": ("Recompute preemption: a pool smaller than the work in flight",
                       "16 requests in flight (closed loop) on a 48-block pool against the slot cache's size; a "
                       "preempted request gives back its blocks and later recomputes prompt + produced tokens."),
        "main": ("The configured run", "`policy`, `workload` and `load` as composed in params.yaml."),
    }
    renders = {**tables.TABLES, "precision_policies": lambda rows: precision_table.render(
        rows, prec, read(results / "cost_model.json"), read(results / "simulation.json"))}
    for name, rows in results_by_table.items():
        if name in renders:
            body, m = renders[name](rows)
            title, note = notes[name]
            parts.append(section(title, note + inputs.note(results / "engine" / f"{name}.json") + marked(rows), body))
            metrics.update(m)
    for file, render, title, note in (
            ("cache.json", tables.cache, "The cache has to change first (seed 003 §3)",
             "Growing `torch.cat` cache against the slot cache."),
            ("cost_model.json", tables.cost_model, "Step-time cost model (seed 003 §5-6)",
             "step = fixed + a sum of what the step computes (prompt tokens, decode rows, sampled rows, query-key "
             "pairs of each attention part as computed, a mixed pass), each term >= 0, fitted by non-negative least "
             "squares on relative error to every measured step of the replays at the configured precision level (each "
             "level's own model: the precision section)."),
            ("simulation.json", tables.validation, "Simulator validation (seed 003 §6)",
             "The same scheduler on a virtual clock driven by the cost model, replaying every real run's workload.")):
        result = read(results / file)
        if result:
            body, m = render(result)
            parts.append(section(title, note + inputs.note(results / file), body))
            metrics.update(m)
    sim = read(results / "simulation.json")
    if sim:
        parts.append(section("Load sweep (simulated)", "Load as a multiple of full-batch decode capacity.",
                             tables.sweep_table(sim, "load.multiple", "load") + "\n\n" + tables.goodput_knees(sim)
                             + "\n\n" + static_fill_wait(sim, cfg)))
        parts.append(section("Output-length spread sweep (simulated)", "Lognormal sigma of output length at load "
                             f"{table_config(cfg, 'all_policies').load.multiple:g}.",
                             tables.sweep_table(sim, "workload.output.sigma", "sigma")))
        parts.append(section("Seats against reserved KV memory (seed 003 §7, simulated)", "Each seat reserves "
                             "max_request_tokens; KV unused: the reserved K/V the requests did not hold, over all "
                             "steps (the replays' measure, on the simulated steps).", tables.sweep_table(
                                 sim, "policy.max_running", "seats",
                                 ((0, "tokens reserved per seat", lambda r: str(r["reserved_tokens_per_seat"])),
                                  (0, "KV unused", lambda r: f"{r['kv_unused']:.0%}")))))
    spec = read(results / "speculation.json")
    if spec:
        body, m = speculation.render(spec)
        parts.append(section("Speculative decoding against batching", speculation.note(spec)
                             + inputs.note(results / "speculation.json"), body))
        metrics.update(m)
    shaped_result = read(results / "shaped.json")
    if shaped_result:
        for title, note, body, m in shaped.render(shaped_result, results_by_table.get("all_policies", [])):
            parts.append(section(title, note + inputs.note(results / "shaped.json"), body))
            metrics.update(m)
    fleet = read(results / "fleet.json")
    if fleet:
        title, note, body, m = fleet_measured.render(fleet)
        parts.append(section(title, note + inputs.note(results / "fleet.json"), body))
        metrics.update(m)
    servers = read(results / "server" / "servers.json")
    if servers:
        metrics.update({f"server.{r['backend'].replace(', ', '-').replace(' ', '_')}.c{r['concurrency']}.{k}":
                        round(r[k], 4) for r in servers["rows"]
                        for k in ("throughput_tps", "ttft_p50_s", "ttft_p99_s", "max_gap_p99_s")
                        if r.get(k) is not None and r[k] == r[k]})
        if servers.get("open_loop"):
            metrics.update({f"server.open_loop.{k}": round(servers["open_loop"][k], 4)
                            for k in ("throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s")})
    score = reports / "SCOREBOARD.md"
    if servers and score.exists():
        parts.append(section("Scoreboard", "Servers under closed-loop and open-loop load (see SCOREBOARD.md)."
                             + inputs.note(results / "server" / "servers.json"),
                             score.read_text().split("\n", 2)[-1]))
    all_rows = [r for rows in results_by_table.values() for r in rows]
    parts.append(section("Capacity, batch size and what stops you (seed 000)", "",
                         capacity_answer(all_rows, hw, float(cfg.slo.share), shaped_result)))
    kept = models.render(cfg.model.name, metrics, reports, machine)
    if kept:
        parts.append(section("Models: how batching's gains change with the model", "This run's headline figures beside "
                             "each other model's, run on this machine as a DVC experiment (`dvc exp run -S "
                             "model=<name>`, then `python -m pipeline.tools.keep_reports <experiment>`: its reports in "
                             "reports/models/<name>/), the same workloads, loads and SLOs in units of each model's own "
                             "measured step (measured).", kept))
    note, body, m = computed.pointer(reports)
    if body:
        parts.append(section("At GPU scale: computed, not measured", note, body))
        metrics.update(m)
    timed = {**results_by_table, "engine_speed": speed["rows"] if speed else [],
             "servers": servers["rows"] if servers else []}
    account, m = disturbance(timed)
    metrics.update(m)
    foreign = "".join(f"\n- `{name}`: {m['label']} ({m['id']})" for name, m in inputs.foreign.items())
    parts.insert(0, f"# LLM batching lab: report\n\nGenerated by `dvc repro` (stage `report`) from the results under "
                 f"`data/results/`. Model {cfg.model.name}, precision {cfg.precision.name} on {cfg.precision.device}, "
                 f"profile `{cfg.profile.name}`, seed {cfg.seed}. Measured on **{machine['label']}**, "
                 f"{machine['memory_gib']} GiB (machine `{machine['id']}`, reports/machine.json). Every figure is "
                 "measured on this machine unless marked computed"
                 + (f", except these files, labelled where they appear:{foreign}\n" if foreign else ".\n")
                 + f"\n{account}\n")
    plots = sorted((reports / "plots").glob("*.png"))
    if plots:
        parts.append("## Plots\n\n" + "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots) + "\n")
    return "\n".join(parts), dict(sorted(metrics.items()))
