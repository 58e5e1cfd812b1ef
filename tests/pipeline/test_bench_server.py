"""The servers' measuring (pipeline/measuring/servers.py) (its measurements run in the pipeline tests): \
waiting for a server to come
up through its warm-up, each level's unrecorded warm-up round, and a clear message when run alone before the main
replay exists."""
import threading
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import pipeline.measuring.servers as bench
from engine.specs import PolicySpec
from pipeline.config import compose_config
from tests.serving import Server, metric, warming_up


def test_bench_waits_out_a_warm_up_but_not_forever(chat_model, monkeypatch):
    """wait_ready: a server that answers "warming up" is waited for past timeout_s (up to warm_s from its start),
    and killed with an error when still warming up at warm_s."""
    release = warming_up(monkeypatch, 1.0)
    with Server(*chat_model, PolicySpec.of("continuous", 2)) as s:
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
    with pytest.raises(SystemExit, match=r"main\.json is missing.*`dvc repro bench_server`"):
        bench.main_step_s(tmp_path)


@pytest.mark.parametrize("warm_up_tokens", [0, 3])
def test_each_level_is_warmed_up_first_and_the_warm_up_is_not_recorded(chat_model, warm_up_tokens):
    """measure: before a level's n requests, its first c requests run with warm_up_tokens each; the server
    generates those too, but the level's row and records hold only the n measured requests."""
    inf = float("inf")
    with Server(*chat_model, PolicySpec.of("continuous", 4)) as s:
        once = OmegaConf.create({**compose_config([]).measure, "tries": 1})  # a disturbed level is not repeated here
        rows, recs = bench.measure(f"{s.url}/v1", "tiny-chat", "tiny", [2], 3, 5, 60, (inf, inf), 0, warm_up_tokens,
                                   once)
        generated = metric(s.url, "vllm:generation_tokens_total")
    assert rows[0]["requests"] == 3 and rows[0]["complete"] == 3 and rows[0]["errors"] == 0
    assert len(recs[0]) == 3 and recs[0]["num_tokens"].sum() == 15
    assert generated == 15 + 2 * warm_up_tokens
