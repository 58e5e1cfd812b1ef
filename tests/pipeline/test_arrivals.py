"""Arrival processes: gamma gaps of burstiness k hold CV 1/sqrt(k), on/off bursts keep the Azure code trace's share
of near-zero gaps and its idle gaps at the mean rate, a user's trace is replayed with its own gaps (a bad row refused
with its line number), and the load generator's open loop sends at the in-process replay's arrivals."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.config import compose_config
from pipeline.measuring.loadgen import open_loop_times
from pipeline.workloads.arrivals import arrival_seconds, arrival_times, gamma_shape
from pipeline.workloads.generate import build
from pipeline.workloads.shaped import raw_lengths
from pipeline.workloads.traces import read_trace

N = 200_000
AZURE_ROWS = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,879,55
2023-11-16 18:15:55.0000000,91,16
"""


def load(name: str, *overrides):
    return compose_config(["model=tiny-llama", f"load={name}", *overrides]).load


def gaps_of(times):
    return np.diff(times)


@pytest.mark.parametrize("k", [0.25, 1.0, 4.0])
def test_gamma_cv_within_3_percent_of_one_over_sqrt_k(k):
    g = gaps_of(arrival_times(np.random.default_rng(0), N, load("bursty", f"load.burstiness={k}"), rate=2.0))
    cv = g.std() / g.mean()
    print(f"gamma k={k}: CV {cv:.4f} vs {1 / np.sqrt(k):.4f} ({cv * np.sqrt(k) - 1:+.2%}), mean gap {g.mean():.4f}")
    assert cv == pytest.approx(1 / np.sqrt(k), rel=0.03) and g.mean() == pytest.approx(0.5, rel=0.01)


def test_gamma_from_cv_is_the_same_draw_as_burstiness_one_over_cv_squared():
    a = arrival_times(np.random.default_rng(3), 500, load("gamma"), 0.3)  # cv 3
    b = arrival_times(np.random.default_rng(3), 500, load("bursty", f"load.burstiness={1 / 9}"), 0.3)
    assert np.array_equal(a, b) and gamma_shape(load("gamma")) == pytest.approx(1 / 9)
    with pytest.raises(ValueError, match="either `burstiness`"):
        gamma_shape(load("gamma", "+load.burstiness=2"))


def test_poisson_rate_and_first_arrival():
    t = arrival_times(np.random.default_rng(0), N, load("poisson"), rate=4.0)
    g = gaps_of(t)
    assert t[0] == 0 and g.mean() == pytest.approx(0.25, rel=0.01) and g.std() / g.mean() == pytest.approx(1, rel=0.01)


def test_onoff_bursts_idle_gaps_and_mean_rate():
    """At the trace's mean gap of 0.39 s: 39 % of gaps under 10 ms (a little more: some ordinary gaps are that short
    too), idle gaps of 139-217 s, one in 2,200, and the mean gap kept."""
    g = gaps_of(arrival_times(np.random.default_rng(0), 1_000_000, load("onoff"), rate=1 / 0.39))  # s
    under_10ms, idle = (g < 0.010).mean(), g[g > 100]
    print(f"onoff: {under_10ms:.4f} of gaps under 10 ms, {len(idle)} idle gaps of {idle.min():.0f}-{idle.max():.0f} "
          f"s, mean gap {g.mean():.4f} s, CV {g.std() / g.mean():.2f}")
    assert abs(under_10ms - 0.39) < 0.02 and g.mean() == pytest.approx(0.39, rel=0.03)
    assert 139 <= idle.min() and idle.max() <= 217 and len(idle) == pytest.approx(1e6 / 2200, rel=0.15)


def test_trace_replayed_with_its_own_gaps(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(AZURE_ROWS)
    t = read_trace(f)
    assert t["arrival_s"].tolist() == pytest.approx([0, 4.314579, 4.31941, 8.31941])
    assert t["input_tokens"].tolist() == [374, 396, 879, 91] and t["output_tokens"].tolist() == [44, 109, 55, 16]
    ld = load("trace", f"load.file={f}")
    times = arrival_times(np.random.default_rng(0), 4, ld, rate=3 / 8.31941)  # the trace's own mean rate
    assert times.tolist() == pytest.approx(t["arrival_s"].tolist())
    assert arrival_times(np.random.default_rng(0), 3, ld, rate=1.0)[-1] == pytest.approx(2.0)  # stretched
    with pytest.raises(ValueError, match="4 requests in the trace, 5 asked for"):
        arrival_times(np.random.default_rng(0), 5, ld, rate=1.0)


@pytest.mark.parametrize("row, line, what", [
    ("2023-11-16 18:15:56,12,x", 6, "GeneratedTokens 'x' is not a whole number"),
    ("2023-11-16 18:15:56,-3,4", 6, "ContextTokens '-3'"),
    ("yesterday,1,2", 6, "TIMESTAMP 'yesterday' is neither seconds nor a date-time"),
    ("2023-11-16 18:15:56,12", 6, "2 fields"),
    ("2023-11-16 18:15:00,12,3", 6, "goes back in time"),
    ("nan,12,3", 6, "not a finite time"),
])
def test_a_bad_trace_row_is_refused_with_its_line_number(tmp_path, row, line, what):
    f = tmp_path / "bad.csv"
    f.write_text(AZURE_ROWS + row + "\n2023-11-16 18:16:00,1,1\n")
    with pytest.raises(ValueError, match=f"bad.csv, line {line}: .*{what}"):
        read_trace(f)


def test_a_trace_header_is_checked(tmp_path):
    f = tmp_path / "h.csv"
    f.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(ValueError, match=r"line 1: the header is \['time', 'in', 'out'\]"):
        read_trace(f)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(f)


def test_trace_workload_takes_lengths_and_arrivals_from_the_csv(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(AZURE_ROWS)
    wl = build(compose_config(["model=tiny-llama", "workload=trace", "load=trace", f"load.file={f}"]))
    assert wl["prompt_tokens"].tolist() == [374, 396, 457, 91] and wl["output_tokens"].tolist() == [44, 109, 55, 16]
    assert wl["clipped"].tolist() == [False, False, True, False]  # 879 + 55 tokens cut to the 512-token context
    secs = arrival_seconds(wl, compose_config(["load=trace", f"load.file={f}", "load.time_scale=0.5"]).load)
    assert secs.tolist() == pytest.approx([0, 4.314579 / 2, 4.31941 / 2, 8.31941 / 2])
    with pytest.raises(ValueError, match="load=trace"):
        build(compose_config(["model=tiny-llama", "workload=trace"]))


@pytest.mark.parametrize("workload, name", [("azure-code", "onoff"), ("azure-conv", "bursty"), ("headline", "poisson"),
                                            ("headline", "gamma"), ("sharegpt", "all")])
def test_open_loop_sends_at_the_replays_arrivals(workload, name):
    """The load generator's seconds are the replay's steps time-scaled: the same draw from the same seed, and a
    direct draw in seconds after the same lengths gives the same times."""
    c = compose_config(["model=tiny-llama", f"workload={workload}", f"load={name}", "workload.num_requests=400"])
    wl = build(c)
    secs = arrival_seconds(wl, c.load, rate=5.0)
    steps = wl["arrival_steps"].to_numpy()
    assert secs[0] == 0 and np.allclose(secs * steps[-1], steps * secs[-1], rtol=1e-12)
    if name == "all":
        return
    assert (len(secs) - 1) / secs[-1] == pytest.approx(5.0, rel=0.5)
    if "lengths" in c.workload:  # a shaped workload draws its lengths, then its arrivals
        rng = np.random.default_rng(int(c.seed))
        raw_lengths(c, rng)
        assert np.allclose(secs, arrival_times(rng, len(wl), c.load, 5.0), rtol=1e-12, atol=0)


def test_overload_times_are_the_shared_draw():
    ld = OmegaConf.create({"process": "gamma", "burstiness": 0.25})
    times = open_loop_times(ld, 10.0, 30.0, seed=4)
    direct = arrival_times(np.random.default_rng(4), int(10.0 * 30.0 * 2) + 16, ld, 10.0)
    assert times == [float(t) for t in direct if t < 30.0] and len(times) > 200
