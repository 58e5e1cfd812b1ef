"""The precision_policies table: the headline policies at each precision level, each level with its accuracy against
fp32 (reports/precision.json), its measured full-batch step, its own cost model (cost_model.json `levels`) and how
much continuous gains over static there, measured and simulated (simulation.json `levels`)."""
from pipeline.reporting import tables
from pipeline.reporting.tables import fmt, markdown


def level_of(row: dict) -> str:
    return row.get("precision", "fp32")


def accuracy_line(prec: dict | None, level: str) -> str:
    """accuracy_of, with the share of whole greedy requests equal to fp32's where measured."""
    got = (prec or {}).get("levels", {}).get(level)
    extra = f", greedy requests equal {got['greedy_exact']:.0%}" if got and "greedy_exact" in got else ""
    return tables.accuracy_of(prec, level) + extra


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """a[key] / b[key], None where either is missing or b's is 0."""
    return a[key] / b[key] if a and b and a.get(key) is not None and b.get(key) else None


def render(rows: list[dict], prec: dict | None, cost: dict | None = None, sim: dict | None = None):
    """(markdown, metrics) of the precision_policies rows."""
    levels = list(dict.fromkeys(level_of(r) for r in rows))
    fits = (cost or {}).get("levels", {})
    simulated = {(r["precision"], r["policy"]): r for r in (sim or {}).get("levels", [])}
    parts, summary, gains, metrics = [], [], {}, {}
    for level in levels:
        mine = [r for r in rows if level_of(r) == level]
        md, m = tables.all_policies(mine)
        metrics.update(m)
        by = {r["policy"]: r for r in mine}
        step = mine[0]["step_s"]
        md = md.removesuffix("\n\nAll measured.")
        parts.append(f"**{level}** ({accuracy_line(prec, level)}); full-batch decode step, measured: "
                     f"{step * 1e3:.1f} ms.\n\n{md}")
        gain = ratio(by.get("continuous"), by.get("static"), "throughput_tps")
        sim_gain = ratio(simulated.get((level, "continuous")), simulated.get((level, "static")), "throughput_tps")
        if gain is not None:
            gains[level] = gain
            metrics[f"precision_policies.{level}.continuous_static_ratio"] = round(gain, 4)
        fit = fits.get(level)
        one = simulated.get((level, "static"))
        summary.append([level, accuracy_line(prec, level), fmt(step * 1e3, 1), fmt(gain), fmt(
            ratio(by.get("continuous"), by.get("static"), "goodput_tps")), fmt(
            ratio(by.get("static"), by.get("continuous"), "ttft_p99_s")),
            fmt(fit["cost_model"]["fixed"] * 1e3, 2) if fit else "n/a",
            fmt(fit["cost_model"]["coef"]["num_prompt_tokens"] * 1e6, 1) if fit else "n/a",
            f"{fit['fit']['median_rel_error']:.1%}" if fit else "n/a",
            fmt(one["decode_one_row_s"] * 1e3, 1) if one else "n/a",
            fmt(one["step_s"] * 1e3, 1) if one else "n/a", fmt(sim_gain)])
    seats = next(iter(simulated.values()), {}).get("seats", "ref_seats")
    table = markdown(["precision", "accuracy against fp32", "full-batch step, ms", "continuous / static throughput",
                      "continuous / static goodput", "static / continuous TTFT p99", "model: fixed, ms per step",
                      "model: µs per prompt token", "model: median error", "model: 1-row decode step, ms",
                      f"model: {seats}-row decode step, ms", "continuous / static throughput, simulated"], summary)
    text = "\n\n".join(parts) + "\n\nEach level side by side (measured, except the columns of its cost model, fitted " \
        "to its own steps in this table, and the simulated ratio: its cost model driving the same scheduler, median " \
        "of 3 seeds):\n\n" + table
    if gains:
        ref = gains.get("fp32")
        said = ", ".join(f"{g:.2f}x at {lv}" for lv, g in gains.items())
        text += f"\n\nContinuous batching's throughput over static's: {said} (measured)."
        if ref:
            text += " Against fp32's gain: " + ", ".join(
                f"{g / ref - 1:+.0%} at {lv}" for lv, g in gains.items() if lv != "fp32") + "."
    return text, metrics
