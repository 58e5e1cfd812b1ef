"""The simulator is the real scheduler on a virtual clock: exact step arithmetic, and a cost model fit that
recovers known coefficients."""
import numpy as np
import pandas as pd
import pytest

from engine import LLMEngine, SamplingParams
from engine.policies import Chunked
from engine.simulator import CostModel, SimRunner, VirtualClock
from pipeline.config import compose_config
from pipeline.fit_cost_model import fit
from pipeline.metrics import summarize
from pipeline.replay import replay
from pipeline.workloads import build, predicted_static_efficiency

COST = CostModel(fixed=0.02, per_prompt_token=0.001, per_decode_row=0.002, per_kv_token=0.0)


def sim_engine(policy):
    clock = VirtualClock()
    return LLMEngine(None, policy, 4096, runner=SimRunner(COST, clock), clock=clock), clock


def test_one_request_costs_its_prefill_and_decodes():
    eng, clock = sim_engine({"name": "continuous", "max_seats": 4})
    eng.add_request("a", [1] * 100, SamplingParams(max_new_tokens=5, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert clock() == pytest.approx((0.02 + 0.1) + 4 * (0.02 + 0.002))
    assert type(eng.scheduler).__name__ == "Continuous"


def test_chunked_in_simulation_is_the_same_scheduler():
    eng, clock = sim_engine({"name": "chunked", "max_seats": 4, "token_budget": 64})
    assert isinstance(eng.scheduler, Chunked)
    eng.add_request("a", [1] * 100, SamplingParams(max_new_tokens=2, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert [s["num_prompt_tokens"] for s in eng.steps] == [64, 36, 0]


def test_static_efficiency_in_simulation_matches_prediction():
    cfg = compose_config(["model=tiny-llama", "+experiment=static_efficiency", "workload.output.sigma=1.2"])
    wl = build(cfg, None, 512)
    eng, clock = sim_engine({"name": "static", "max_seats": 8, "max_batch": 8})
    req, steps, _ = replay(eng, wl, 0.02, wait_until=lambda t: clock.advance_to(eng.t0 + t))
    assert summarize(req, steps)["slot_efficiency"] == pytest.approx(predicted_static_efficiency(wl["output_tokens"], 8))


def test_fit_recovers_known_costs():
    rng = np.random.default_rng(0)
    steps = pd.DataFrame({"num_prompt_tokens": rng.integers(0, 500, 400), "num_decode_rows": rng.integers(0, 64, 400),
                          "kv_tokens": rng.integers(0, 20000, 400)})
    true = CostModel(0.03, 0.0008, 0.0015, 2e-7)
    steps["duration"] = [true.step_time(*r) * rng.normal(1, 0.01) for r in steps.itertuples(index=False)]
    model, stats = fit(steps)
    assert model.fixed == pytest.approx(0.03, rel=0.05) and model.per_prompt_token == pytest.approx(0.0008, rel=0.05)
    assert stats["median_rel_error"] < 0.02


def test_dynamic_deadline_is_reached_exactly_on_a_virtual_clock():
    """A lone request under dynamic batching launches at its deadline; the simulation never spins short of it."""
    cfg = compose_config(["model=tiny-llama", "policy=dynamic", "workload.num_requests=1", "load=poisson"])
    eng, clock = sim_engine({"name": "dynamic", "max_seats": 8, "max_batch": 8, "max_wait_ms": 300})
    wl = build(cfg, None, 512).assign(arrival_steps=[0.1234567])
    req, _, _ = replay(eng, wl, 0.0371, wait_until=lambda t: clock.advance_to(eng.t0 + t))
    assert req["complete"].all() and req["admit"].iloc[0] == pytest.approx(0.1234567 * 0.0371 + 0.3)
