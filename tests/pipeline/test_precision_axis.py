"""Precision as an axis of the batching question: the precision_policies table's runs at each level (a level the
model or device cannot run left out), the engine replayed at each run's level, a cost model per level, the report's
section and the scoreboard's rows with each level's accuracy (pipeline/reporting/precision_table.py)."""
import json

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

import pipeline.measuring.replay as replay_mod
import pipeline.measuring.servers as bench
from engine.core.simulator import FEATURES, CostModel
from pipeline.config import compose_config
from pipeline.measuring.fingerprint import environment
from pipeline.modeling.cost_fit import fit_replays
from pipeline.modeling.simulation import level_gains
from pipeline.reporting import precision_table, report
from pipeline.reporting.scoreboard import scoreboard
from pipeline.reporting.tables import cost_model
from pipeline.workloads.runs import runs

LEVELS = ("fp32", "w4", "bf16")
POLICIES = ("static", "dynamic", "continuous", "chunked")
PREC = {"reference": "fp32", "levels": {
    "w4": {"lossless": True, "kld_mean": 2e-11, "top1": 1.0, "greedy_exact": 1.0},
    "bf16": {"lossless": False, "kld_mean": 1.9e-4, "top1": 0.9975, "greedy_exact": 0.9375}}}


def test_the_table_runs_each_policy_at_each_level():
    base = compose_config([])
    assert "precision_policies" in base.tables
    got = [(cfg.precision.name, cfg.policy.name, cfg.workload.name) for _, cfg in runs(base, "precision_policies")]
    assert got == [(lv, p, "headline") for lv in LEVELS for p in POLICIES]


def test_a_level_the_model_cannot_run_is_left_out():
    """tiny-chat has no GGUF file: its table runs fp32 and bf16, and says why w4 is not run."""
    got = {cfg.precision.name for _, cfg in runs(compose_config(["model=tiny-chat"]), "precision_policies")}
    assert got == {"fp32", "bf16"}


def test_on_another_device_the_points_run_at_the_configured_level():
    """On a GPU run (bf16-cuda) no CPU level runs: the table's policies run once each, at the configured level."""
    got = runs(compose_config(["precision=bf16-cuda"]), "precision_policies")
    assert [(name, cfg.precision.name) for name, cfg in got] == [(f"policy={p}", "bf16-cuda") for p in POLICIES]


def test_each_run_is_replayed_on_the_engine_at_its_level(monkeypatch):
    """run_table asks for the model of each run's level and the row names that level."""
    asked = []
    monkeypatch.setattr(replay_mod, "run_one", lambda model, cfg, wl, table, name, cache: (
        {"point": name, "model": model}, None, None))
    rows, _, _ = replay_mod.run_table(lambda cfg: asked.append(cfg.precision.name) or f"net-{cfg.precision.name}",
                                      compose_config(["model=tiny-chat"]), "precision_policies",
                                      pd.DataFrame({"point": []}))
    assert asked == ["fp32"] * 4 + ["bf16"] * 4
    assert [r["model"] for r in rows] == ["net-fp32"] * 4 + ["net-bf16"] * 4


def test_an_engine_server_starts_at_its_runs_level(monkeypatch):
    monkeypatch.setattr(bench, "running", lambda args, **kw: args)
    monkeypatch.setattr(bench, "wait_ready", lambda proc, port, name: proc)
    cfg = compose_config([])
    run = OmegaConf.create({"name": "e", "server": "engine", "policy": "continuous", "max_running": 4,
                            "precision": "w4"})
    assert "precision=w4" in bench.start(cfg, run, 64)[0]
    assert "precision=fp32" in bench.start(cfg, OmegaConf.create({**run, "precision": None}), 64)[0]
    hf = OmegaConf.create({"name": "h", "server": "naive"})
    assert "precision=fp32" in bench.start(cfg, hf, 64)[0]


def steps_of(cost: CostModel, n: int, rng) -> pd.DataFrame:
    steps = pd.DataFrame({"kind": "decode", "num_prompt_tokens": rng.integers(0, 300, n),
                          "num_decode_rows": rng.integers(1, 9, n), "num_sampled_rows": rng.integers(1, 9, n),
                          "decode_attention": rng.integers(0, 5000, n), "prompt_attention": rng.integers(0, 9000, n),
                          "is_mixed": rng.integers(0, 2, n), "multi_row": rng.integers(0, 2, n)})
    steps["duration"] = [cost.predict(r) for r in steps.to_dict("records")]
    return steps


def test_a_cost_model_is_fitted_per_level():
    """The configured level's model from every table's steps at that level; one per level from precision_policies;
    a w4 step cheap at one row (small fixed cost) is told apart from fp32's."""
    rng = np.random.default_rng(0)
    coef = {f: 1e-4 for f in FEATURES}
    fp32, w4 = CostModel(0.02, coef), CostModel(0.005, {**coef, "num_decode_rows": 2e-3})
    machine = {"id": "m", "label": "a CPU"}
    meta = {"config": {"precision": {"name": "fp32"}}, "machine": machine}
    tables = {"all_policies": {"rows": [{"point": "policy=static"}], **meta},
              "precision_policies": {"rows": [{"point": "precision=fp32 policy=static", "precision": "fp32"},
                                              {"point": "precision=w4 policy=static", "precision": "w4"}], **meta}}
    steps = pd.concat([steps_of(fp32, 200, rng).assign(table="all_policies", point="policy=static"),
                       steps_of(fp32, 200, rng).assign(table="precision_policies",
                                                       point="precision=fp32 policy=static"),
                       steps_of(w4, 200, rng).assign(table="precision_policies", point="precision=w4 policy=static")],
                      ignore_index=True)
    hw = {"ridge_flop_per_byte": 10.0, "weight_bytes": 4e8, "params": 1e8}
    out = fit_replays(tables, steps, hw, "precision_policies")
    assert out["precision"] == "fp32" and out["fit"]["steps"] == 400 and set(out["levels"]) == {"fp32", "w4"}
    assert out["cost_model"]["fixed"] == pytest.approx(0.02, rel=1e-3)
    assert out["levels"]["w4"]["cost_model"]["fixed"] == pytest.approx(0.005, rel=1e-3)
    assert out["levels"]["w4"]["fit"]["steps"] == 200
    assert "levels" in fit_replays(tables, steps, hw) and fit_replays(tables, steps, hw)["levels"] == {}
    assert "disturbed" not in out["fit"] and out["fit"]["left_out_runs"] == []
    for t in tables.values():  # a machine busy throughout: every replay disturbed; fitted to them all, said
        t["rows"] = [{**r, "disturbed": True} for r in t["rows"]]
    busy = fit_replays(tables, steps, hw)
    assert busy["fit"]["disturbed"] is True and busy["fit"]["steps"] == 400 and busy["fit"]["left_out_runs"] == []
    assert busy["cost_model"]["fixed"] == pytest.approx(0.02, rel=1e-3)
    assert "coefficients are those of a busy machine" in cost_model(busy)[0]


def test_each_level_drives_the_same_policies_in_simulation():
    base = compose_config(["model=tiny-llama"])
    cheap_one_row = CostModel(0.002, {"num_prompt_tokens": 1e-4, "num_decode_rows": 4e-3})
    flat = CostModel(0.02, {"num_prompt_tokens": 1e-4, "num_decode_rows": 1e-3})
    out = level_gains({"w4": cheap_one_row, "fp32": flat}, base, policies=("static", "continuous"), seeds=(0,))
    assert [(r["precision"], r["policy"]) for r in out] == [("w4", "static"), ("w4", "continuous"),
                                                             ("fp32", "static"), ("fp32", "continuous")]
    w4 = out[0]
    assert w4["decode_one_row_s"] == pytest.approx(0.006) and w4["step_s"] == pytest.approx(0.002 + 8 * 4e-3)
    assert all(r["throughput_tps"] > 0 for r in out)


def rows_at(level: str, step_s: float, static_tps: float, continuous_tps: float) -> list[dict]:
    tps = {"static": static_tps, "dynamic": static_tps, "continuous": continuous_tps, "chunked": continuous_tps}
    return [{"table": "precision_policies", "point": f"precision={level} policy={p}", "policy": p,
             "precision": level, "step_s": step_s, "throughput_tps": tps[p], "goodput_tps": tps[p] / 2,
             "ttft_p50_s": 0.5, "ttft_p99_s": 1.0 if p in ("static", "dynamic") else 0.5, "tpot_p50_s": 0.04,
             "itl_p99_s": 0.1, "slot_efficiency": 1.0} for p in POLICIES]


ROWS = rows_at("fp32", 0.05, 80.0, 120.0) + rows_at("w4", 0.02, 100.0, 120.0) + rows_at("bf16", 0.04, 90.0, 135.0)


def test_the_section_shows_each_level_with_its_accuracy_and_the_gain():
    text, metrics = precision_table.render(ROWS, PREC)
    assert "**fp32** (reference)" in text
    assert "**w4** (lossless: KLD 2.0e-11, top-1 100.00%, greedy requests equal 100%)" in text
    assert "**bf16** (lossy: KLD 1.9e-04, top-1 99.75%, greedy requests equal 94%)" in text
    assert "full-batch decode step, measured: 20.0 ms" in text
    assert "1.50x at fp32, 1.20x at w4, 1.50x at bf16 (measured)" in text and "-20% at w4, +0% at bf16" in text
    assert metrics["precision_policies.w4.continuous.throughput_tps"] == 120.0
    assert metrics["precision_policies.w4.continuous_static_ratio"] == 1.2
    assert text.count("| continuous |") == 3


def test_the_report_has_the_section_from_the_results(tmp_path):
    here = environment(2)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "machine.json").write_text(json.dumps(here))
    (tmp_path / "reports" / "precision.json").write_text(json.dumps({
        **PREC, "positions": 10, "near_tie": 1e-3, "lossless_kld": 10.0, "lossless_top1": 0.999, "machine": here,
        "noise_floor": {"kld_mean": 0.0, "comparisons": {}},
        "levels": {k: {**v, "kld_p99": 0.0, "kld_max": 0.0, "top1_no_ties": v["top1"], "ppl_delta": 0.0}
                   for k, v in PREC["levels"].items()}}))
    (tmp_path / "data" / "results" / "engine").mkdir(parents=True)
    (tmp_path / "data" / "results" / "engine" / "precision_policies.json").write_text(
        json.dumps({"rows": ROWS, "machine": here}))
    text, metrics = report.build(compose_config([]), tmp_path)
    assert "## Precision as an axis: the headline policies at each precision level" in text
    assert "**w4** (lossless: KLD 2.0e-11" in text and "**bf16** (lossy: KLD 1.9e-04" in text
    assert metrics["precision_policies.bf16.continuous_static_ratio"] == 1.5


def test_the_scoreboard_has_the_engine_server_at_each_level():
    def row(backend, level, c, tps):
        return {"backend": backend, "precision": level, "concurrency": c, "complete": 4, "requests": 4,
                "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "throughput_tps": tps, "per_stream_tps": 10.0,
                "max_gap_p99_s": 0.1, "errors": 0}
    rows = [row("engine-continuous", "fp32", 1, 40.0), row("engine-continuous", "fp32", 64, 400.0),
            row("engine-continuous-w4", "w4", 1, 120.0), row("engine-continuous-w4", "w4", 64, 330.0),
            row("engine-continuous-bf16", "bf16", 1, 70.0), row("engine-continuous-bf16", "bf16", 64, 320.0)]
    text = scoreboard(rows, {"label": "a CPU", "id": "m"}, None, None, PREC)
    assert "| engine-continuous-w4 | w4 | lossless: KLD 2.0e-11, top-1 100.00% | 64 |" in text
    assert "| engine-continuous-bf16 | bf16 | lossy: KLD 1.9e-04, top-1 99.75% | 1 |" in text
    assert "c = 1 / 64 (measured): fp32 40.0 / 400.0 tok/s (reference); w4 120.0 / 330.0 tok/s" in text
    assert "at each precision level" not in scoreboard(rows[:2], {"label": "a CPU", "id": "m"}, None, None, PREC)
