"""The servers under pressure: 429 by count and by time with Retry-After, deadlines, disconnects that abort the
request and free the seat, graceful drain and SIGTERM, backend failures that answer every client, and metrics that
count what was served."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from servers.worker import EngineWorker
from tests.serving import (BACKENDS, ONE_SEAT, Server, client, free_port, metric, slow_steps, wait_for,
                           warming_up)

HI = [{"role": "user", "content": "hi"}]


def test_429_with_retry_after(chat_model):
    with Server(*chat_model, {"name": "static", "max_seats": 8, "max_batch": 8}, max_waiting=1) as s:
        body = {"messages": HI, "max_tokens": 4}
        outcome = []

        def waiter():  # never answered: static waits for 8; its timeout is expected
            try:
                httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=3)
                outcome.append("answered")
            except httpx.ReadTimeout:
                outcome.append("timeout")
        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        wait_for(lambda: s.worker.queued() >= 1, 5, "the first request never reached the queue")
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and "queue" in r.json()["error"]["message"]
        t.join(timeout=10)
        assert outcome == ["timeout"]


def test_wait_estimate_prices_one_prefill_step_per_admission():
    """Queued requests admitted at the same decode step share one prefill step; prompt tokens cost the measured
    marginal rate, net of the step's fixed cost (a decode step)."""
    w = EngineWorker(SimpleNamespace(scheduler=SimpleNamespace(seats=SimpleNamespace(num_seats=4)), compiled=False), 16)
    w._measure("decode", 0.1, 0)
    w._measure("prefill", 0.6, 1000)
    assert w.prefill_s == pytest.approx(0.0005)  # (0.6 - 0.1) / 1000 s per prompt token
    w.ahead = ([10, 10, 20, 30], [(100, 5), (100, 5)])  # tokens left per running request; queued (prompt, max)
    # both queued take the seats freeing at step 10 (one prefill step); the new one the next seat, at step 15
    assert w.wait_estimate(50, 8) == pytest.approx((15 + 2) * 0.1 + 250 * 0.0005)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
@pytest.mark.parametrize("backend", ["engine", "batcher"])
def test_disconnect_aborts_and_frees_the_seat(chat_model, backend, stream):
    """Steps slowed to 10 ms: 400 tokens would take 4 s. The client leaves after ~0.3 s; the request must be
    aborted (far fewer tokens computed than asked, an abort counted) and its seat free within a step or two."""
    with Server(*chat_model, ONE_SEAT[backend]) as s:
        undo = slow_steps(s, 0.01)
        body = {"messages": HI, "max_tokens": 400, "stream": stream, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(10, read=0.3)) as h:
            if stream:  # leave after a few chunks
                with h.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i > 4:
                            break
            else:       # give up waiting for the whole answer
                with pytest.raises(httpx.ReadTimeout):
                    h.post(f"{s.url}/v1/chat/completions", json=body)
        left = time.monotonic()
        wait_for(lambda: s.worker.num_running == 0, 5, "the abandoned request kept its seat")
        assert time.monotonic() - left < 1.0  # a few 10 ms steps, not the 4 s of the whole request
        undo()
        computed = metric(s.url, "vllm:generation_tokens_total")
        assert computed < 200, computed
        assert metric(s.url, "vllm:request_success_total", finished_reason="abort") == 1
        r = client(s).chat.completions.create(model="tiny-chat", messages=HI, max_tokens=3,
                                              extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert metric(s.url, "vllm:generation_tokens_total") - computed == 3  # the abandoned one computes no more


def test_overload_answers_429_at_once_with_retry_after_from_the_estimate(chat_model):
    """One seat, steps slowed by 20 ms: a 150-token request holds the seat for seconds. A newcomer's estimated
    wait is over the 1 s allowed: 429 at once, and Retry-After plus that 1 s is about when the seat really frees.
    A client deadline (the header the OpenAI SDKs send) under the estimate is refused the same way even when the
    server's own limit is generous."""
    for limit in (1.0, 1000.0):
        with Server(*chat_model, ONE_SEAT["engine"], max_queue_wait_s=limit) as s:
            undo = slow_steps(s, 0.02)
            long = threading.Thread(target=httpx.post, args=(f"{s.url}/v1/chat/completions",),
                                    kwargs={"json": {"messages": HI, "max_tokens": 150, "ignore_eos": True},
                                            "timeout": 60}, daemon=True)
            long.start()
            try:
                wait_for(lambda: s.worker.decode_s is not None and s.worker.num_running == 1, 10, "no decode ran")
                t = time.monotonic()
                if limit == 1.0:
                    r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 4}, timeout=10)
                    assert time.monotonic() - t < 0.5 and r.status_code == 429, r.text
                    assert "estimated wait" in r.json()["error"]["message"]
                    retry = int(r.headers["retry-after"])
                    wait_for(lambda: s.worker.num_running == 0, 60, "the long request never finished")
                    actual = time.monotonic() - t
                    assert retry >= 1 and abs(retry + limit - actual) < max(2.0, 0.5 * actual), (retry, actual)
                else:
                    with pytest.raises(openai.RateLimitError, match="estimated wait"):
                        client(s).with_options(timeout=1.0).chat.completions.create(model="tiny-chat", messages=HI,
                                                                                      max_tokens=4)
                    assert time.monotonic() - t < 0.5
            finally:
                undo()
                long.join(timeout=60)


def test_deadline_passed_in_the_queue_drops_the_request(chat_model):
    """A lone request on pure static batching waits forever; with a 0.5 s deadline (the header the OpenAI SDKs
    send) it is dropped from the queue and answered 408, streaming or not."""
    with Server(*chat_model, {"name": "static", "max_seats": 8, "max_batch": 8}) as s:
        head = {"x-stainless-read-timeout": "0.5"}
        t = time.monotonic()
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 4}, headers=head, timeout=10)
        assert r.status_code == 408 and "deadline" in r.json()["error"]["message"]
        assert 0.4 < time.monotonic() - t < 3
        wait_for(lambda: s.worker.queued() == 0, 5, "the expired request stayed in the queue")
        with httpx.Client(timeout=10) as h, h.stream("POST", f"{s.url}/v1/chat/completions", headers=head,
                                                      json={"messages": HI, "max_tokens": 4, "stream": True}) as r:
            msgs = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert msgs[-1]["error"]["code"] == 408
        wait_for(lambda: s.worker.queued() == 0, 5, "the expired request stayed in the queue")


@pytest.mark.parametrize("backend", ["engine", "batcher"])
def test_drain_finishes_what_it_can_and_fails_the_rest(chat_model, backend):
    """Steps slowed by 20 ms. A 4-token request finishes inside a 1 s grace; a 300-token one (6 s) is failed
    with a shutdown event at the grace's end; meanwhile /health says draining and newcomers get 503; the
    worker's loop then ends."""
    two = {"engine": {"name": "continuous", "max_seats": 2},
           "batcher": {"name": "generate", "max_batch": 2, "max_wait_ms": 1000}}
    with Server(*chat_model, two[backend]) as s:
        undo = slow_steps(s, 0.02)
        results = {}

        def post(name, n):
            body = {"messages": HI, "max_tokens": n, "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=30) as h, h.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                results[name] = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        try:
            threads = [threading.Thread(target=post, args=(name, n)) for name, n in (("short", 4), ("long", 300))]
            for t in threads:
                t.start()
            wait_for(lambda: s.worker.num_running == 2, 10, "the two requests never ran together")
            t0 = time.monotonic()
            s.worker.drain(1.0)
            h = httpx.get(f"{s.url}/health")
            assert h.status_code == 503 and h.json()["status"] == "draining"
            r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI}, timeout=5)
            assert r.status_code == 503 and "retry on another replica" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 0.9  # refused at once, not failed at the grace's end
            for t in threads:
                t.join(timeout=30)
            wait_for(lambda: not s.worker._thread.is_alive(), 10, "the worker loop did not end after the drain")
            assert time.monotonic() - t0 < 5
        finally:
            undo()
        assert results["short"][-1]["choices"][0]["finish_reason"] == "length"
        assert "shutting down" in results["long"][-1]["error"]["message"]


def test_requests_wait_for_the_warm_up(chat_model, monkeypatch):
    """An engine with compiled steps is warmed up (LLMEngine.warm_up) before it serves: meanwhile /health is 503
    "warming up" and a request gets 503 with Retry-After; then both are served, /health giving the warm-up's
    seconds."""
    release = warming_up(monkeypatch, 2.5)
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}) as s:
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and h.json()["status"] == "warming up"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and "warming up" in r.json()["error"]["message"]
        release.set()
        wait_for(lambda: httpx.get(f"{s.url}/health").status_code == 200, 10, "still warming up after the release")
        assert httpx.get(f"{s.url}/health").json()["warm_up_s"] == 2.5
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_engine_failure_fails_requests_and_shows_on_health(chat_model):
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}) as s:
        def boom():
            raise RuntimeError("simulated fault")
        s.engine.runner.run = lambda *a, **k: boom()
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI}, timeout=10)
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and "simulated fault" in h.json()["error"]
        assert metric(s.url, "vllm:request_success_total", finished_reason="error") == 1
        assert httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI}, timeout=10).status_code == 503


@pytest.mark.parametrize("backend", ["naive", "batcher"])
def test_generate_failure_mid_request_answers_every_client(chat_model, backend):
    """generate raises on its 4th forward pass: the streaming client in flight gets an error event, the
    non-streaming ones (in flight or queued) a 500, and /health says down."""
    with Server(*chat_model, {**BACKENDS[backend], "max_wait_ms": 200}) as s:
        calls = []

        def fault(*_):
            calls.append(1)
            time.sleep(0.02)
            if len(calls) >= 4:
                raise RuntimeError("simulated generate fault")
        hook = s.worker.model.register_forward_pre_hook(fault)
        results = {}

        def post(name, stream):
            body = {"messages": HI, "max_tokens": 50, "ignore_eos": True, "stream": stream}
            with httpx.Client(timeout=20) as h, h.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                results[name] = (r.status_code, [line for line in r.iter_lines() if line])
        try:
            threads = [threading.Thread(target=post, args=(n, n == "streamed")) for n in ("streamed", "a", "b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
        finally:
            hook.remove()
        assert set(results) == {"streamed", "a", "b"}, "a client was left hanging"
        status, lines = results["streamed"]
        assert status == 200 and "generate backend failed" in lines[-2] and lines[-1] == "data: [DONE]"
        for name in ("a", "b"):
            status, lines = results[name]
            assert status == 500 and "generate backend failed" in json.loads(lines[0])["error"]["message"]
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and "simulated generate fault" in h.json()["error"]


def test_paged_server_exports_blocks_and_prefix_hits(chat_model):
    """On paged KV, /metrics counts prefix-cache queries and hits in tokens (vLLM's names) and KV usage in blocks:
    the same prompt twice, in turn; the second finds every full block of the first but the one holding its last
    token, and computes only the rest."""
    kv = {"name": "paged", "block_size": 4, "num_blocks": 64}
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}, kv=kv) as s:
        msgs = [{"role": "user", "content": "tell me about the sea " * 6}]
        p = [client(s).chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=3).usage.prompt_tokens
             for _ in range(2)][0]
        hits = metric(s.url, "vllm:prefix_cache_hits_total")
        assert hits == (p - 1) // 4 * 4 and metric(s.url, "vllm:prefix_cache_queries_total") == 2 * p
        assert metric(s.url, "vllm:prompt_tokens_total") == 2 * p - hits
        assert metric(s.url, "vllm:num_preemptions_total") == 0
        assert 0 < metric(s.url, "vllm:kv_cache_usage_perc") <= 1


def test_metrics_count_what_was_served(server):
    """Sample values after one known request: tokens generated equal the tokens asked, one TTFT observation,
    three gaps, one success by length, the prompt counted, no seat in use after it."""
    r = client(server).chat.completions.create(model="tiny-chat", messages=HI, max_tokens=4,
                                               extra_body={"ignore_eos": True})
    u = server.url
    assert metric(u, "vllm:generation_tokens_total") == 4
    assert metric(u, "vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert metric(u, "vllm:time_to_first_token_seconds_count") == 1
    assert metric(u, "vllm:inter_token_latency_seconds_count") == 3
    assert metric(u, "vllm:e2e_request_latency_seconds_count") == 1
    assert metric(u, "vllm:request_success_total", finished_reason="length") == 1
    assert metric(u, "vllm:iteration_tokens_total_count") >= 4
    assert metric(u, "vllm:num_requests_running") == 0 and metric(u, "vllm:kv_cache_usage_perc") == 0
    assert httpx.get(f"{u}/health").json()["rss_mb"] > 10


def test_http_thread_cpu_is_the_event_loops_own(server):
    """lab:http_thread_cpu_seconds counts the HTTP thread's CPU only: it grows while tokens stream, and not while
    another thread of the process burns 0.3 s of CPU."""
    from pipeline.bench_server import http_cpu_s
    base = f"{server.url}/v1"
    before = http_cpu_s(base)
    for _ in range(3):
        list(client(server).chat.completions.create(model="tiny-chat", messages=HI, max_tokens=8, stream=True,
                                                    extra_body={"ignore_eos": True}))
    served = http_cpu_s(base)
    t = time.thread_time()
    while time.thread_time() - t < 0.3:  # this (the test's) thread
        pass
    idle = http_cpu_s(base)
    assert 0 <= before < served
    assert idle - served < 0.1
    assert http_cpu_s(f"http://127.0.0.1:{free_port()}/v1") is None  # nothing there: no figure


def test_sigterm_drains_then_exits_zero(smollm2_tokenizer_dir):
    """A real server process (static batching, batches of 2): two requests run, a third waits for a partner.
    SIGTERM: /health says draining, new requests get 503, the two running finish whole, the waiting one ends
    with an error event when the 5 s grace is over, and the process exits 0."""
    port = free_port()
    cmd = [sys.executable, "-m", "servers", "model=tiny-chat", f"model.tokenizer={smollm2_tokenizer_dir}",
           "policy=static", "policy.max_batch=2", "policy.max_seats=4", f"port={port}", "server.shutdown_grace_s=5",
           "threads=1"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "LAB_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 120, "the server process did not come up within 120 s")
        results = {}

        def post(name, n):
            body = {"messages": HI, "max_tokens": n, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.Client(timeout=60) as h, h.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                results[name] = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        pair = [threading.Thread(target=post, args=(n, 40)) for n in ("a", "b")]
        for t in pair:
            t.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["running"] == 2 or len(results) == 2, 30, "no pair ran")
        lone = threading.Thread(target=post, args=("lone", 4))
        lone.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] == 1, 30,
                 f"the lone request never queued: {httpx.get(f'{url}/health').json()}, {list(results)}")
        proc.send_signal(signal.SIGTERM)
        h = httpx.get(f"{url}/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "draining"
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and "retry on another replica" in r.json()["error"]["message"]
        for t in pair + [lone]:
            t.join(timeout=30)
        assert proc.wait(timeout=30) == 0
        for name in ("a", "b"):
            assert results[name][-1]["usage"]["completion_tokens"] == 40, name
        assert "shutting down" in results["lone"][-2]["error"]["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_pure_static_never_answers_a_lone_request(chat_model, stream):
    """max_batch 8 and no deadline: a lone request waits forever (seed 000's break-it); leaving dequeues it."""
    with Server(*chat_model, {"name": "static", "max_seats": 8, "max_batch": 8}, max_waiting=4) as s:
        body = {"messages": HI, "max_tokens": 4, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(10, read=1.0)) as h:
                with h.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
        wait_for(lambda: s.worker.queued() == 0, 5, "the abandoned request stayed in the queue")
        assert metric(s.url, "vllm:request_success_total", finished_reason="abort") == 1
