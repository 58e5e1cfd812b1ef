"""The servers starting, failing and stopping: requests wait for the warm-up, backend failures answer every client
and show on /health, a drain finishes what it can within the grace, and SIGTERM drains then exits 0."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.specs import PolicySpec
from tests.serving import BACKENDS, Server, free_port, metric, slow_steps, wait_for, warming_up

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("backend", ["engine", "batcher"])
def test_drain_finishes_what_it_can_and_fails_the_rest(chat_model, backend):
    """Steps slowed by 20 ms. A 4-token request finishes inside a 1 s grace; a 300-token one (6 s) is failed
    with a shutdown event at the grace's end; meanwhile /health says draining and newcomers get 503; the
    worker's loop then ends."""
    two = {"engine": PolicySpec.of("continuous", 2),
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
    with Server(*chat_model, PolicySpec.of("continuous", 2)) as s:
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
    with Server(*chat_model, PolicySpec.of("continuous", 2)) as s:
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


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(smollm2_tokenizer_dir):
    """A real server process (static batching, batches of 2): two requests run, a third waits for a partner.
    SIGTERM: /health says draining, new requests get 503, the two running finish whole, the waiting one ends
    with an error event when the 5 s grace is over, and the process exits 0. Before that: with server.max_connections
    connections open and idle, one more gets 503 (uvicorn's limit), and the server serves again once they close."""
    port = free_port()
    cmd = [sys.executable, "-m", "servers", "model=tiny-chat", f"model.tokenizer={smollm2_tokenizer_dir}",
           "policy=static", "policy.max_batch=2", "policy.max_running=4", f"port={port}", "server.shutdown_grace_s=5",
           "threads=1", "server.max_connections=8"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "LAB_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 120, "the server process did not come up within 120 s")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]  # never send a byte
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10, "over the cap, still served")
        for conn in idle:
            conn.close()
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 10, "not served again")
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
