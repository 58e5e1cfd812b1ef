"""The production-shaped sections on synthetic results: places against the seeds', what changed, the simulator's
agreement (Spearman, median error) and the capacity table with its measured runs marked."""
import math

import pandas as pd

from pipeline.modeling.shaped import agreement
from pipeline.reporting import shaped

POLICIES = ["static", "continuous", "chunked"]
SEEDS = [{"policy": p, "throughput_tps": t, "ttft_p99_s": f} for p, t, f in
         (("static", 50.0, 2.0), ("continuous", 100.0, 0.5), ("chunked", 120.0, 0.4))]


def run(workload, k, policy, tps, ttft, sim_scale=1.1, disturbed=False):
    return {"workload": workload, "lengths": f"{workload} lengths / 8", "burstiness": k, "multiple": 0.1,
            "policy": policy, "rate_rps": 2.0, "throughput_tps": tps, "goodput_tps": tps / 2, "ttft_p50_s": ttft / 2,
            "ttft_p99_s": ttft, "tpot_p50_s": 0.03, "itl_p99_s": 0.05, "preemptions": 0, "complete": 8,
            "requests": 8, "ttft_limit_s": 1.0, "tpot_limit_s": 0.1, "disturbed": disturbed,
            "sim_throughput_tps": tps * sim_scale, "sim_ttft_p99_s": ttft * sim_scale}


def result():
    # conv keeps the seeds' order; code k=0.25 puts static first by throughput and chunked last by both
    measured = [run("conv", 1.0, "static", 50.0, 2.0), run("conv", 1.0, "continuous", 90.0, 0.6),
                run("conv", 1.0, "chunked", 110.0, 0.5),
                run("code", 0.25, "static", 30.0, 0.9), run("code", 0.25, "continuous", 20.0, 1.5),
                run("code", 0.25, "chunked", 10.0, 3.0)]
    caps = [{"workload": r["workload"], "lengths": r["lengths"], "burstiness": r["burstiness"], "policy": r["policy"],
             "capacity_rps": 1.5, "capacity_multiple": 0.1, "ttft_limit_s": 1.0, "tpot_limit_s": 0.1}
            for r in measured]
    return {"lengths": {"conv": "conv lengths / 8", "code": "code lengths / 8"}, "reference": "continuous",
            "near": 1.0, "loads": {"conv": 0.1, "code": 0.1}, "step_s": 0.03, "sweep": measured,
            "capacities": caps, "at_load": measured, "measured": measured,
            "agreement": agreement(pd.DataFrame(measured)),
            "timing": {"simulated_s": 1.0, "simulated_runs": 6, "measured_s": 2.0, "measured_runs": 6}}


def test_places_best_first_ties_share():
    rows = [{"policy": "a", "throughput_tps": 5.0, "ttft_p99_s": 1.0},
            {"policy": "b", "throughput_tps": 7.0, "ttft_p99_s": 1.0},
            {"policy": "c", "throughput_tps": float("nan"), "ttft_p99_s": 0.5}]
    assert shaped.ranks(rows, "throughput_tps") == {"b": 1, "a": 2, "c": 3}
    assert shaped.ranks(rows, "ttft_p99_s") == {"c": 1, "a": 2, "b": 2}


def test_table_shows_each_place_beside_the_seeds():
    md, metrics = shaped.measured_table(result(), SEEDS)
    static_code = next(line for line in md.splitlines() if "code lengths / 8, k = 0.25 | static" in line)
    assert "| 1 (3) | 1 (3) |" in static_code
    assert metrics["shaped.code.k0.25.static.throughput_tps"] == 30.0


def test_what_changed_names_leaders_and_moves():
    text = shaped.changes(result(), SEEDS)
    conv, code = text.splitlines()[2:4]
    assert "throughput led by chunked (seeds: chunked), no place moved by two" in conv
    assert "throughput led by static (seeds: chunked)" in code and "static 3 → 1" in code
    assert "chunked 1 → 3 (10.00 against static's 30.00)" in code


def test_agreement_pooled_within_cells_and_error():
    df = pd.DataFrame(result()["measured"])
    st = agreement(df)
    assert math.isclose(st["throughput_tps"]["spearman"], 1.0)
    assert math.isclose(st["throughput_tps"]["median_rel_error"], 0.1)
    assert st["ttft_p99_s"]["runs"] == 6
    df.loc[df["workload"] == "code", "sim_throughput_tps"] = [10.0, 20.0, 30.0]  # the order reversed in one cell
    got = agreement(df)["throughput_tps"]
    assert math.isclose(got["spearman_within_cells_median"], 0.0)  # median of +1 and -1
    df.loc[0, "disturbed"] = True
    assert agreement(df)["throughput_tps"]["runs"] == 5


def test_capacity_table_marks_the_measured_runs():
    md, metrics = shaped.capacity_table(result())
    assert "1.50 [measured at 2.00: missed]" in md  # conv static: TTFT p99 2.0 s over 1.0
    assert "1.50 [measured at 2.00: met]" in md
    assert metrics["shaped.capacity.conv.k1.continuous"] == 1.5


def test_agreement_table_gives_both_run_sets():
    res = result()
    res["measured"][0]["disturbed"] = True
    md, metrics = shaped.agreement_table(res)
    assert "| throughput | not disturbed | 1.00 | 1.00 | 10% | 5 |" in md
    assert "| throughput | all, disturbed included | 1.00 | 1.00 | 10% | 6 |" in md
    assert metrics["shaped.simulation.with_disturbed.ttft_p99_s.runs"] == 6


def test_render_gives_every_section():
    titles = [s[0] for s in shaped.render(result(), SEEDS)]
    assert len(titles) == 4 and titles[0] == "Do the policies' leads survive production shapes?"
