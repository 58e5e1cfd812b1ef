"""Workloads are seeded data; static slot efficiency measured on the engine matches the prediction from the workload."""
import time

import numpy as np
import pandas as pd
import pytest

from engine import SamplingParams
from engine.factory import build_engine
from engine.specs import PolicySpec
from pipeline.config import compose_config, policy_spec
from pipeline.measuring.metrics import summarize
from pipeline.measuring.replay import replay
from pipeline.workloads.generate import build, predicted_static_efficiency


def cfg(*overrides):
    return compose_config(["model=tiny-llama", *overrides])


def test_same_seed_same_workload_and_other_seed_differs():
    a, b = build(cfg()), build(cfg())
    pd.testing.assert_frame_equal(a, b)
    assert not build(cfg("seed=1"))["arrival_steps"].equals(a["arrival_steps"])


def test_output_lengths_and_arrival_rate():
    c = cfg("workload.num_requests=2000", "workload.output.sigma=0.4", "load.multiple=0.5")
    w = build(c)
    assert w["output_tokens"].mean() == pytest.approx(c.workload.output.mean * c.profile.output_scale, rel=0.05)
    rate = (len(w) - 1) / w["arrival_steps"].iloc[-1]          # requests per step
    assert rate == pytest.approx(0.5 * 8 / w["output_tokens"].mean(), rel=0.1)
    assert 0.07 < w["is_long"].mean() < 0.13


def test_predicted_static_efficiency_by_hand():
    assert predicted_static_efficiency([1, 3, 2, 2], batch=2) == pytest.approx(8 / (2 * 3 + 2 * 2))


@pytest.mark.parametrize("sigma", [0.0, 0.4, 0.8, 1.2])
def test_static_slot_efficiency_measured_matches_predicted(tiny_llama, sigma):
    c = cfg("+experiment=static_efficiency", f"workload.output.sigma={sigma}")
    wl = build(c, None, 512)
    eng = build_engine(tiny_llama, policy_spec(c.policy), 512)
    req, steps, _ = replay(eng, wl, step_s=0.001)
    measured = summarize(req, steps)["slot_efficiency"]
    assert abs(measured - predicted_static_efficiency(wl["output_tokens"], 8)) < 0.005
    assert req["complete"].all()


def test_pure_static_never_fills_and_is_reported_incomplete(tiny_llama):
    """Seed 000's break-it: a lone request under pure static batching never starts; the replay ends, no hang."""
    c = cfg("policy=static", "workload.num_requests=3", "load=all")
    eng = build_engine(tiny_llama, policy_spec(c.policy), 512)
    req, steps, wall = replay(eng, build(c, None, 512), step_s=0.001)
    assert not req["complete"].any() and len(steps) == 0 and wall < 5


def test_closed_loop_keeps_c_in_flight(tiny_llama):
    c = cfg("load=closed", "load.concurrency=2", "workload.num_requests=6", "policy.max_running=4")
    eng = build_engine(tiny_llama, policy_spec(c.policy), 512)
    req, steps, _ = replay(eng, build(c, None, 512), step_s=0.001, concurrency=int(c.load.concurrency))
    assert req["complete"].all()
    assert max(steps["useful_rows"]) <= 2 and np.isclose(req["arrival"].min(), 0.0)


def test_same_seed_same_sampled_tokens(tiny_llama):
    p = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    runs = [build_engine(tiny_llama, PolicySpec.of("continuous", 2), 64, seed=3).generate([[5, 6], [7]], p)
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("policy", [PolicySpec.of("continuous", 4),
                                    policy_spec("dynamic", max_batch=4, max_wait_ms=2000)])
def test_idle_gaps_cost_no_wall_time_and_keep_every_time(tiny_llama, policy):
    """Three requests 30 s apart (a dynamic batcher also waiting out its 2 s deadline): the replay skips what the
    engine spends idle, so it takes seconds, while every arrival and token keeps its place on the replay clock."""
    wl = pd.DataFrame({"rid": ["a", "b", "c"], "prompt": [[5, 6, 7]] * 3, "prompt_tokens": [3] * 3,
                       "output_tokens": [4] * 3, "arrival_steps": [0, 3000, 6000], "is_long": [False] * 3})
    eng = build_engine(tiny_llama, policy, 64)
    t0 = time.perf_counter()
    req, steps, wall = replay(eng, wl, step_s=0.01)
    assert time.perf_counter() - t0 < 10 and wall > 60
    assert req["complete"].all() and list(req["arrival"]) == [0.0, 30.0, 60.0]
    wait = 2.0 if policy.name == "dynamic" else 0.0  # a lone request launches at its deadline
    assert all(wait <= f - a < wait + 1 for a, f in zip(req["arrival"], req["first_token"]))
