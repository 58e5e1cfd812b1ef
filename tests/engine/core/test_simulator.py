"""The simulator is the real scheduler on a virtual clock: exact step arithmetic, and a cost model fit that
recovers known coefficients."""
import numpy as np
import pandas as pd
import pytest

from engine import SamplingParams
from engine.core.policies import Chunked
from engine.core.simulator import CostModel, SimRunner, VirtualClock
from engine.factory import build_engine
from engine.specs import PolicySpec
from pipeline.config import compose_config
from pipeline.measuring.metrics import summarize
from pipeline.measuring.replay import replay
from pipeline.modeling.cost_fit import fit
from pipeline.workloads.generate import build, predicted_static_efficiency

COST = CostModel(fixed=0.02, coef={"num_prompt_tokens": 0.001, "num_decode_rows": 0.002})


def sim_engine(policy):
    clock = VirtualClock()
    return build_engine(None, policy, 4096, runner=SimRunner(COST, clock), clock=clock), clock


def test_one_request_costs_its_prefill_and_decodes():
    eng, clock = sim_engine(PolicySpec.of("continuous", 4))
    eng.add_request("a", [1] * 100, SamplingParams(max_new_tokens=5, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert clock() == pytest.approx((0.02 + 0.1) + 4 * (0.02 + 0.002))
    assert type(eng.scheduler).__name__ == "Continuous"


def test_chunked_in_simulation_is_the_same_scheduler():
    eng, clock = sim_engine(PolicySpec.of("chunked", 4, token_budget=64))
    assert isinstance(eng.scheduler, Chunked)
    eng.add_request("a", [1] * 100, SamplingParams(max_new_tokens=2, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert [r.num_prompt_tokens for r in eng.records] == [64, 36, 0]


def test_static_efficiency_in_simulation_matches_prediction():
    cfg = compose_config(["model=tiny-llama", "+experiment=static_efficiency", "workload.output.sigma=1.2"])
    wl = build(cfg, None, 512)
    eng, clock = sim_engine(PolicySpec.of("static", 8, max_batch=8))
    req, steps, _ = replay(eng, wl, 0.02, wait_until=lambda t: clock.advance_to(eng.t0 + t))
    assert summarize(req, steps)["slot_efficiency"] == pytest.approx(
        predicted_static_efficiency(wl["output_tokens"], 8))


def test_fit_recovers_known_costs_and_reports_each_kind():
    rng = np.random.default_rng(0)
    n = 600
    kind = rng.choice(["prefill", "decode", "mixed"], n)
    steps = pd.DataFrame({"kind": kind,
                          "num_prompt_tokens": np.where(kind == "decode", 0, rng.integers(1, 500, n)),
                          "num_decode_rows": np.where(kind == "prefill", 0, rng.integers(1, 64, n)),
                          "num_sampled_rows": rng.integers(1, 64, n), "decode_attention": rng.integers(0, 20000, n),
                          "prompt_attention": rng.integers(0, 200000, n), "is_mixed": (kind == "mixed").astype(int),
                          "multi_row": rng.integers(0, 2, n)})
    true = CostModel(0.03, {"num_prompt_tokens": 8e-4, "num_decode_rows": 1.5e-3, "num_sampled_rows": 5e-4,
                            "decode_attention": 2e-7, "prompt_attention": 1e-8, "is_mixed": 0.004,
                            "multi_row": 0.02})
    steps["duration"] = [true.predict(r) * rng.normal(1, 0.01) for r in steps.to_dict("records")]
    model, stats = fit(steps)
    assert model.fixed == pytest.approx(0.03, rel=0.05)
    for f, c in true.coef.items():
        assert model.coef[f] == pytest.approx(c, rel=0.1), f
    assert stats["median_rel_error"] < 0.02 and set(stats["per_kind"]) == {"prefill", "decode", "mixed"}
    assert all(v["steps"] > 100 for v in stats["per_kind"].values())


def test_fit_never_goes_negative():
    """A feature that does not matter (or anti-correlates through noise) gets 0, not a negative cost."""
    rng = np.random.default_rng(1)
    steps = pd.DataFrame({f: rng.integers(0, 100, 200) for f in ("num_prompt_tokens", "num_decode_rows",
                                                                "num_sampled_rows", "decode_attention",
                                                                "prompt_attention", "is_mixed", "multi_row")})
    steps["kind"] = "decode"
    steps["duration"] = 0.05 - 1e-4 * steps["prompt_attention"] + 1e-3 * steps["num_decode_rows"] + 0.011
    model, _ = fit(steps)
    assert min(model.coef.values()) >= 0 and model.fixed >= 0


def test_one_definition_of_step_features():
    """The engine's per-step records carry exactly the features the simulator's clock charges."""
    eng, clock = sim_engine(PolicySpec.of("chunked", 4, token_budget=8))
    for i in range(3):
        eng.add_request(str(i), [1] * (5 + 7 * i), SamplingParams(max_new_tokens=3, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert clock() == pytest.approx(sum(COST.predict(r) for r in eng.records))
    assert {r.kind for r in eng.records} >= {"prefill", "mixed", "decode"}


def test_dynamic_deadline_is_reached_exactly_on_a_virtual_clock():
    """A lone request under dynamic batching launches at its deadline; the simulation never spins short of it."""
    cfg = compose_config(["model=tiny-llama", "policy=dynamic", "workload.num_requests=1", "load=poisson"])
    eng, clock = sim_engine(PolicySpec.of("dynamic", 8, max_batch=8, max_wait_ms=300))
    wl = build(cfg, None, 512).assign(arrival_steps=[0.1234567])
    req, _, _ = replay(eng, wl, 0.0371, wait_until=lambda t: clock.advance_to(eng.t0 + t))
    assert req["complete"].all() and req["admit"].iloc[0] == pytest.approx(0.1234567 * 0.0371 + 0.3)
