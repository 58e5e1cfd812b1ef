"""Figures you can trust on a shared machine: a run beside a busy process is seen as disturbed and measured again,
an impossible figure is never written, and the engine's threads follow the cores other processes leave free."""
import json
import math
import os
import time

import pytest
import torch
from omegaconf import OmegaConf

from engine import threads
from engine.usage import CpuTimes, other_cpu_share
from pipeline.measuring import disturbance
from pipeline.measuring.disturbance import Disturbance, ImpossibleFigure, Watch, measured
from pipeline.results import write_json, write_parquet
from pipeline.tools.neighbour import spin

LIMITS = OmegaConf.create({"other_cpu_max": 0.3, "steal_max": 0.1, "tries": 3})
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores: one for the run, one for the neighbour")
def test_a_busy_neighbour_is_seen_and_the_runs_own_cpu_is_not():
    proc = spin()
    try:
        time.sleep(0.3)
        with Watch(LIMITS) as w:
            busy_wait(1.5)
    finally:
        proc.kill()
        proc.wait()
    d = w.result
    assert d.other_cpu_share >= 0.5 and d.disturbed, d
    assert d.own_cpu_share >= 0.3, d  # this process's own busy work is its own, not another's


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores: one for the run, one for the server")
def test_a_servers_cpu_is_the_runs_own_when_named():
    """The same second watched twice: without the server named, its CPU counts as another process's; named, as the
    run's own (whatever else the machine does meanwhile shows in both alike)."""
    server = spin()  # stands in for a server process under load
    try:
        time.sleep(0.3)
        with Watch(LIMITS) as anonymous, Watch(LIMITS, pids=[server.pid]) as named:
            time.sleep(1.5)
    finally:
        server.kill()
        server.wait()
    moved = anonymous.result.other_cpu_share - named.result.other_cpu_share
    assert moved >= 0.5 and named.result.own_cpu_share - anonymous.result.own_cpu_share == pytest.approx(moved, abs=0.1)


def fake_watches(monkeypatch, disturbed: list[bool]):
    """Watches that report these verdicts in turn."""
    verdicts = iter(disturbed)
    monkeypatch.setattr(Watch, "__exit__", lambda self, *exc: setattr(
        self, "result", Disturbance(1.0, 0.9, 0.0, 1.0, True) if next(verdicts) else Disturbance(1.0, 0.0, 0.0, 1.0,
                                                                                                  False)))


def test_a_disturbed_run_is_measured_again_then_kept_and_labelled(monkeypatch, capsys):
    calls = []
    fake_watches(monkeypatch, [True, True, False])
    out, d = measured(lambda: calls.append(1) or len(calls), LIMITS, "case")
    assert out == 3 and d.tries == 3 and not d.disturbed
    fake_watches(monkeypatch, [True, True, True])
    out, d = measured(lambda: calls.append(1) or len(calls), LIMITS, "stubborn")
    assert out == 6 and d.tries == 3 and d.disturbed
    assert "stubborn: disturbed" in capsys.readouterr().err


def test_an_impossible_result_is_measured_again_then_refused():
    results = iter([-5.0, 7.0])

    def check(x):
        if x < 0:
            raise ImpossibleFigure(f"rate = {x}")

    out, _ = measured(lambda: next(results), LIMITS, "case", check=check)
    assert out == 7.0
    with pytest.raises(ImpossibleFigure, match="rate = -1"):
        measured(lambda: -1.0, OmegaConf.create({**LIMITS, "tries": 2}), "case", check=check)


@pytest.mark.parametrize("row, field", [
    ({"batch": 64, "hf_decode_tps": -6463.0}, "rows[0].hf_decode_tps"),
    ({"batch": 1, "engine_tps": math.inf}, "rows[0].engine_tps"),
    ({"batch": 1, "floor_fraction": math.nan}, "rows[0].floor_fraction"),
    ({"point": "x", "ttft_p50_s": -0.1}, "rows[0].ttft_p50_s"),
    ({"point": "x", "requests": 8, "complete": 9}, "complete = 9 > requests = 8"),
])
def test_the_writer_refuses_an_impossible_figure_and_keeps_the_good_file(tmp_path, row, field):
    path = tmp_path / "speed.json"
    write_json(path, {"rows": [{"batch": 1, "engine_tps": 30.0}]})
    with pytest.raises(ImpossibleFigure) as err:
        write_json(path, {"rows": [row]})
    assert field in str(err.value)
    assert json.loads(path.read_text())["rows"][0]["engine_tps"] == 30.0  # the good file stays
    with pytest.raises(ImpossibleFigure):
        import pandas as pd

        write_parquet(tmp_path / "runs.parquet", pd.DataFrame([row]))


def test_nan_times_mean_not_measured_and_pass(tmp_path):
    rows = {"rows": [{"point": "x", "ttft_long_p50_s": math.nan, "ttft_limit_s": math.inf}]}
    write_json(tmp_path / "ok.json", rows)
    back = json.loads((tmp_path / "ok.json").read_text())["rows"][0]
    assert back["point"] == "x" and math.isnan(back["ttft_long_p50_s"]) and back["ttft_limit_s"] == math.inf


def test_the_engines_threads_follow_the_free_cores(monkeypatch):
    """The governor's rule on given readings (the readings themselves are tested above, on a real neighbour): a
    neighbour's CPU takes a core away for as long as it lasts, and never the last one."""
    t0 = time.perf_counter() - 100  # readings from the past: each look is due
    samples = iter([CpuTimes(t0, 0.0, 0.0, 0.0),        # wall s, machine busy and steal CPU s, this process's CPU s
                    CpuTimes(t0 + 1, 1.7, 0.2, 0.9),    # a neighbour used 1.0 CPU beside our 0.9 (0.2 of it stolen)
                    CpuTimes(t0 + 2, 3.4, 0.4, 1.0),    # two neighbours' worth: still one thread, never none
                    CpuTimes(t0 + 3, 4.4, 0.4, 1.95)])  # quiet again: 0.05 CPU of others
    monkeypatch.setattr(threads.ThreadGovernor, "_sample", staticmethod(lambda: next(samples)))
    before = torch.get_num_threads()
    try:
        gov = threads.ThreadGovernor(2, 0.6, 0.5)
        gov.cores = 2
        seen = []
        for _ in range(3):
            gov.tick()
            seen.append(torch.get_num_threads())
        assert seen == [1, 1, 2]
    finally:
        torch.set_num_threads(before)


def test_steal_is_other_work_for_the_watch_as_for_the_governor(monkeypatch):
    """Time the hypervisor gave another guest is time other work took from this machine: counted in other work's
    share (and shown alone as the steal share)."""
    a, b = CpuTimes(0.0, 10.0, 1.0, 5.0), CpuTimes(2.0, 10.8, 1.6, 5.8)  # the run busy 0.8 s, 0.6 s stolen, in 2 s
    assert other_cpu_share(a, b) == pytest.approx(0.3)
    readings = iter([a, b])
    monkeypatch.setattr(disturbance, "cpu_times", lambda pids: next(readings))
    with Watch(LIMITS) as w:
        pass
    assert (w.result.other_cpu_share, w.result.steal_share, w.result.own_cpu_share) == pytest.approx((0.3, 0.3, 0.4))
    assert w.result.disturbed  # steal above steal_max


def test_server_pids_name_a_live_process_only():
    proc = spin()
    assert disturbance.server_pids(proc) == [proc.pid]
    proc.kill()
    proc.wait()
    assert disturbance.server_pids(None) == []
