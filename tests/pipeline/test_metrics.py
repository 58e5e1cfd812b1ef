"""The metric definitions on hand-made records, where every figure can be worked out by hand."""
import pandas as pd
import pytest

from pipeline.measuring.metrics import summarize


def records():
    return pd.DataFrame([
        # arrival 0; tokens at 1, 2, 4 -> TTFT 1, TPOT 1.5, gaps 1, 2
        {"arrival": 0.0, "first_token": 1.0, "finish": 4.0, "token_times": [1.0, 2.0, 4.0], "num_tokens": 3,
         "complete": True, "is_long": False},
        # arrival 1; tokens at 5, 6 -> TTFT 4 (misses a 2 s TTFT limit), TPOT 1
        {"arrival": 1.0, "first_token": 5.0, "finish": 6.0, "token_times": [5.0, 6.0], "num_tokens": 2,
         "complete": True, "is_long": True},
    ])


def test_latency_definitions():
    s = summarize(records())
    assert s["ttft_p50_s"] == pytest.approx(2.5)
    assert s["tpot_p50_s"] == pytest.approx(1.25)
    assert s["itl_max_s"] == 2.0 and s["itl_p50_s"] == pytest.approx(1.0)
    assert s["ttft_long_p50_s"] == 4.0 and s["ttft_short_p50_s"] == 1.0


def test_throughput_and_goodput():
    s = summarize(records(), ttft_limit=2.0, tpot_limit=2.0)
    assert s["wall_s"] == 6.0 and s["tokens"] == 5
    assert s["throughput_tps"] == pytest.approx(5 / 6)
    assert s["goodput_tps"] == pytest.approx(3 / 6)  # only the first request met both limits
    assert s["slo_met"] == 0.5


def test_slot_efficiency_and_live_rows():
    steps = pd.DataFrame({"duration": [0.1, 0.1, 0.2], "useful_rows": [4, 2, 1], "computed_rows": [4, 4, 4]})
    s = summarize(records(), steps)
    assert s["slot_efficiency"] == pytest.approx(7 / 12) and s["live_rows"] == pytest.approx(7 / 3)
    assert s["max_step_s"] == 0.2


def test_incomplete_requests_are_counted_not_dropped():
    df = records()
    df.loc[1, ["first_token", "finish", "complete", "num_tokens"]] = [None, None, False, 0]
    df.at[1, "token_times"] = []
    s = summarize(df, ttft_limit=10, tpot_limit=10)
    assert s["requests"] == 2 and s["complete"] == 1 and s["goodput_tps"] == pytest.approx(3 / 4)
