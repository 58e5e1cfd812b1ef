"""pipeline.bench_server's own behaviour (its measurements run in the pipeline tests): waiting for a server to come
up through its warm-up, and a clear message when run alone before the main replay exists."""
import threading
import time
from types import SimpleNamespace

import pytest

import pipeline.bench_server as bench
from pipeline.config import compose_config
from tests.serving import Server, warming_up


def test_bench_waits_out_a_warm_up_but_not_forever(chat_model, monkeypatch):
    """wait_ready: a server that answers "warming up" is waited for past timeout_s (up to warm_s from its start),
    and killed with an error when still warming up at warm_s."""
    release = warming_up(monkeypatch, 1.0)
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}) as s:
        killed = []
        proc = SimpleNamespace(poll=lambda: None, kill=lambda: killed.append(1))
        with pytest.raises(RuntimeError, match="did not come up"):
            bench.wait_ready(proc, s.port, "warming", timeout_s=0.2, warm_s=1.0)
        assert killed == [1]
        threading.Timer(1.0, release.set).start()
        t0 = time.monotonic()
        assert bench.wait_ready(proc, s.port, "warming", timeout_s=0.2, warm_s=30) is proc
        assert time.monotonic() - t0 >= 0.5 and killed == [1]


def test_bench_without_the_main_replay_says_what_to_run(tmp_path, monkeypatch):
    """bench_server alone on a fresh checkout (no data/results yet): a message naming the command, no traceback."""
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"main\.json is missing.*`dvc repro bench_server`"):
        bench.main(compose_config([]))
