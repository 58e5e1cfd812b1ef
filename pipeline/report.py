"""Stage report: reports/REPORT.md and reports/metrics.json, generated from the results; never edited by hand."""
import json
import math

from pipeline import tables
from pipeline.config import ROOT, load
from pipeline.io import write_json, write_text

RESULTS = ROOT / "data" / "results"
REPORTS = ROOT / "reports"


class MixedMachines(SystemExit):
    """Figures of two machines would meet in one report."""


class Inputs:
    """Reads the report's inputs and checks that each was measured on this machine (reports/machine.json).

    A file named in `other_machine` (config report.other_machine) may come from another machine; its section then
    says whose figures they are. Any other mismatch stops the report with an error naming both machines."""

    def __init__(self, machine: dict, other_machine=()):
        self.machine, self.other = machine, set(other_machine)
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

    @staticmethod
    def name(path) -> str:
        """A results file as the config names it: relative to the repository."""
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)

    def note(self, path) -> str:
        """'' for this machine's file, else a sentence saying whose figures these are."""
        theirs = self.foreign.get(self.name(path))
        return f" **Measured on another machine: {theirs['label']} ({theirs['id']}), not this one.**" if theirs else ""


def engine_tables(inputs: Inputs) -> dict[str, list[dict]]:
    return {p.stem: inputs.read(p)["rows"] for p in sorted((RESULTS / "engine").glob("*.json"))}


def section(title: str, note: str, body: str) -> str:
    return f"## {title}\n\n{note}\n\n{body}\n"


def engine_speed_section(rows: list[dict]) -> tuple[str, dict]:
    body = tables.markdown(
        ["B", "prompt tokens", "new tokens", "engine tok/s", "HF tok/s", "ratio", "engine prefill, s",
         "HF prefill, s", "engine decode tok/s", "HF decode tok/s", "decode ratio", "engine weights, MB",
         "KV cache, MB", "peak, MB", "compiled", "paged decode tok/s", "paged/slot decode", "decode / floor"],
        [[r["batch"], r["prompt_tokens"], r["new_tokens"], tables.fmt(r["engine_tps"], 1), tables.fmt(r["hf_tps"], 1),
          tables.fmt(r["ratio"]), tables.fmt(r["engine_prefill_s"]), tables.fmt(r["hf_prefill_s"]),
          tables.fmt(r["engine_decode_tps"], 1), tables.fmt(r["hf_decode_tps"], 1), tables.fmt(r["decode_ratio"]),
          tables.fmt(r["engine_weight_bytes"] / 1e6, 0), tables.fmt(r["kv_cache_bytes"] / 1e6, 0),
          tables.fmt(r["engine_peak_mb"], 0), "yes" if r.get("compile") else "no",
          tables.fmt(r.get("paged_decode_tps"), 1), tables.fmt(r.get("paged_decode_ratio")),
          tables.fmt(r.get("floor_fraction"))] for r in rows])
    metrics = {f"engine_speed.b{r['batch']}_p{r['prompt_tokens']}.{k}": round(r[k], 3) for r in rows
               for k in ("engine_tps", "hf_tps", "ratio", "decode_ratio", "paged_decode_ratio", "floor_fraction") if k in r}
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


def capacity_answer(rows: list[dict], hw: dict | None) -> str:
    """Seed 000's question: capacity at the SLO, the batch size to pick, and what stops a bigger batch."""
    ok = [r for r in rows if r.get("ttft_p99_s") is not None and not math.isnan(r["ttft_p99_s"])
          and r["ttft_p99_s"] <= r["ttft_limit_s"] and r.get("tpot_p50_s", 0) <= r["tpot_limit_s"]]
    lines = []
    if ok:
        best = max(ok, key=lambda r: r["throughput_tps"])
        lines.append(f"- **Capacity at the SLO** (TTFT p99 ≤ {best['ttft_limit_s']:.2f} s, TPOT p50 ≤ "
                     f"{best['tpot_limit_s'] * 1e3:.0f} ms): {best['throughput_tps']:.1f} tok/s, by `{best['point']}` "
                     f"in table {best['table']} (measured).")
    else:
        lines.append("- **Capacity at the SLO**: no run met the SLO.")
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
                     f"{hw['gflops']['fp32' if hw['dtype'] == 'float32' else 'bf16']:.0f} GFLOP/s) stops a bigger "
                     f"batch first here because the ridge is low; on a GPU memory speed and then memory space do.")
    return "\n".join(lines)


def static_fill_wait(sim: dict, cfg) -> str:
    """Seed 003's open question: why static's TTFT p99 rises as load falls. A batch waits for max_batch arrivals."""
    rows = {r["value"]: r for r in sim["sweeps"] if r["axis"] == "load.multiple" and r["policy"] == "static"}
    lo, nxt = sorted(rows)[:2]
    mean_out = cfg.workload.output.mean * cfg.profile.output_scale
    rate = lo * cfg.load.get("ref_seats", 8) / mean_out / sim["step_s"]  # requests per second at the lightest load
    fill = (cfg.policy.get("max_batch", 8) - 1) / rate
    return (f"Static's TTFT p99 is {rows[lo]['ttft_p99_s']:.1f} s at load {lo:g} against {rows[nxt]['ttft_p99_s']:.1f} s "
            f"at {nxt:g} (simulated): a static batch launches only when {cfg.policy.get('max_batch', 8)} requests "
            f"have arrived, and at load {lo:g} the first of them waits {fill:.1f} s on average for the other "
            f"{cfg.policy.get('max_batch', 8) - 1} (computed: (max_batch - 1) / arrival rate). The lighter the load, "
            "the longer the wait: the direction is right, not an artefact.")


def main(cfg):
    machine = json.loads((REPORTS / "machine.json").read_text())
    inputs = Inputs(machine, cfg.report.other_machine)
    read = inputs.read
    parts, metrics = [], {}
    hw = read(REPORTS / "hardware.json")
    eq = read(REPORTS / "equivalence.json")
    if eq:
        parts.append(section("Correctness", "Seed 000's scenario (six requests, three seats, staggered arrivals): "
                             "requests whose tokens equal Hugging Face `generate` run alone, per policy (measured)."
                             + inputs.note(REPORTS / "equivalence.json"),
                             tables.markdown(["policy", "token-equal"],
                                             [[p, f"{n}/{eq['requests']}"] for p, n in eq["matches"].items()])))
        metrics.update({f"equivalence.{p}": n / eq["requests"] for p, n in eq["matches"].items()})
    speed = read(REPORTS / "engine_speed.json")
    if speed:
        body, m = engine_speed_section(speed["rows"])
        parts.append(section("Engine against Hugging Face generate", "Same model, dtype and requests in one "
                             "process; B requests at once, exact new tokens (`python -m pipeline.engine_speed`). "
                             "decode / floor: the engine's decode rate against its matrix products alone, run "
                             "for as many steps right after each engine run (the fastest such run)."
                             + inputs.note(REPORTS / "engine_speed.json") + machine_dependence(hw), body))
        metrics.update(m)
    results = engine_tables(inputs)
    notes = {
        "static_efficiency": ("Static batching's zombie rows (seed 003 §1)", "8 seats, saturated arrivals."),
        "dynamic_timeouts": ("Dynamic batching: timeouts at light and saturating load (seed 003 §2)",
                             "Load as a multiple of the measured full-batch decode capacity."),
        "all_policies": ("All policies on the headline workload (seed 003 §4, §6; the §2 length oracle)",
                         "Same arrivals for every policy. `bucketed` is an oracle: it reads each request's true "
                         "output length."),
        "prefill_stall": ("Prefill stalls decode (seed 003 §5)", "15% long prompts."),
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
    for name, rows in results.items():
        if name in tables.TABLES:
            body, m = tables.TABLES[name](rows)
            title, note = notes[name]
            parts.append(section(title, note + inputs.note(RESULTS / "engine" / f"{name}.json"), body))
            metrics.update(m)
    for file, render, title, note in (
            ("cache.json", tables.cache, "The cache has to change first (seed 003 §3)",
             "Growing `torch.cat` cache against the slot cache."),
            ("cost_model.json", tables.cost_model, "Step-time cost model (seed 003 §5-6)",
             "step = fixed + a sum of what the step computes (prompt tokens, decode rows, sampled rows, query-key "
             "pairs of each attention part as computed, a mixed pass), each term >= 0, fitted by non-negative least "
             "squares on relative error to every measured step of the replays."),
            ("simulation.json", tables.validation, "Simulator validation (seed 003 §6)",
             "The same scheduler on a virtual clock driven by the cost model, replaying every real run's workload.")):
        result = read(RESULTS / file)
        if result:
            body, m = render(result)
            parts.append(section(title, note + inputs.note(RESULTS / file), body))
            metrics.update(m)
    sim = read(RESULTS / "simulation.json")
    if sim:
        parts.append(section("Load sweep (simulated)", "Load as a multiple of full-batch decode capacity.",
                             tables.sweep_table(sim, "load.multiple", "load") + "\n\n" + tables.goodput_knees(sim)
                             + "\n\n" + static_fill_wait(sim, cfg)))
        parts.append(section("Output-length spread sweep (simulated)", "Lognormal sigma of output length at load "
                             "0.8.", tables.sweep_table(sim, "workload.output.sigma", "sigma")))
        parts.append(section("Seats against reserved KV memory (seed 003 §7, simulated)", "Each seat reserves the "
                             "worst case (longest prompt + longest output); the unused fraction is computed from "
                             "the workload.", tables.sweep_table(
                                 sim, "policy.max_seats", "seats",
                                 ((0, "tokens reserved per seat (computed)", lambda r: str(r["reserved_tokens_per_seat"])),
                                  (0, "KV unused (computed)", lambda r: f"{r['kv_unused_fraction']:.0%}")))))
    servers = read(RESULTS / "server" / "servers.json")
    if servers:
        metrics.update({f"server.{r['backend'].replace(', ', '-').replace(' ', '_')}.c{r['concurrency']}.{k}":
                        round(r[k], 4) for r in servers["rows"]
                        for k in ("throughput_tps", "ttft_p50_s", "ttft_p99_s", "max_gap_p99_s")
                        if r.get(k) is not None and r[k] == r[k]})
        if servers.get("open_loop"):
            metrics.update({f"server.open_loop.{k}": round(servers["open_loop"][k], 4)
                            for k in ("throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s")})
    score = REPORTS / "SCOREBOARD.md"
    if servers and score.exists():
        parts.append(section("Scoreboard", "Servers under closed-loop and open-loop load (see SCOREBOARD.md)."
                             + inputs.note(RESULTS / "server" / "servers.json"),
                             score.read_text().split("\n", 2)[-1]))
    all_rows = [r for rows in results.values() for r in rows]
    parts.append(section("Capacity, batch size and what stops you (seed 000)", "", capacity_answer(all_rows, hw)))
    foreign = "".join(f"\n- `{name}`: {m['label']} ({m['id']})" for name, m in inputs.foreign.items())
    parts.insert(0, f"# LLM batching lab: report\n\nGenerated by `dvc repro` (stage `report`) from the results under "
                 f"`data/results/`. Model {cfg.model.name}, {cfg.precision.dtype} on {cfg.precision.device}, profile "
                 f"`{cfg.profile.name}`, seed {cfg.seed}. Measured on **{machine['label']}**, {machine['memory_gib']} "
                 f"GiB (machine `{machine['id']}`, reports/machine.json). Every figure is measured on this machine "
                 "unless marked computed" + (f", except these files, labelled where they appear:{foreign}\n" if foreign
                                              else ".\n"))
    plots = sorted((REPORTS / "plots").glob("*.png"))
    if plots:
        parts.append("## Plots\n\n" + "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots) + "\n")
    write_text(REPORTS / "REPORT.md", "\n".join(parts))
    write_json(REPORTS / "metrics.json", dict(sorted(metrics.items())))


if __name__ == "__main__":
    main(load())
