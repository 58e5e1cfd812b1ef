"""Capacity at the SLO on a latency curve with a known answer: the largest rate whose p99 TTFT and p50 TPOT meet
the limits (pipeline.measuring.metrics.capacity_at_slo)."""
import math

from pipeline.measuring.metrics import capacity_at_slo, meets_limits


def curve(rates, ttft0=0.1, tpot0=0.02, capacity=10.0) -> list[dict]:
    """A queue's latency against load: both grow as 1 / (1 - rate / capacity), monotone up to capacity."""
    return [{"rate_rps": r, "multiple": r / capacity, "ttft_p99_s": ttft0 / (1 - r / capacity),
             "tpot_p50_s": tpot0 / (1 - r / capacity)} for r in rates]


RATES = [1.0, 2.0, 4.0, 6.0, 8.0, 9.0, 9.5]


def test_ttft_limit_binds_at_the_known_rate():
    # ttft 0.1 / (1 - r/10) <= 0.55 while r <= 8.18: 8 the largest rate on the curve
    assert capacity_at_slo(curve(RATES), 0.55, 1.0) == 8.0


def test_tpot_limit_binds_when_tighter():
    # tpot 0.02 / (1 - r/10) <= 0.055 while r <= 6.36; ttft allows up to 8
    assert capacity_at_slo(curve(RATES), 0.55, 0.055) == 6.0


def test_the_load_multiple_as_well_as_the_rate():
    assert math.isclose(capacity_at_slo(curve(RATES), 0.55, 1.0, "multiple"), 0.8)


def test_none_met_is_zero_and_all_met_is_the_top():
    assert capacity_at_slo(curve(RATES), 0.05, 1.0) == 0.0
    assert capacity_at_slo(curve(RATES), 100.0, 100.0) == 9.5


def test_no_tpot_is_judged_on_ttft_alone():
    one_token = {"rate_rps": 3.0, "ttft_p99_s": 0.2, "tpot_p50_s": float("nan")}
    assert meets_limits(one_token, 0.5, 0.01)
    assert not meets_limits({**one_token, "ttft_p99_s": float("nan")}, 0.5, 0.01)
