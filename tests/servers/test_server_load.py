"""The servers under pressure: 429 by count and by time with Retry-After, deadlines, disconnects that abort the
request and free the seat, metrics that count what was served, and speculative decoding under load (starting,
failing and stopping: tests/servers/test_server_lifecycle.py)."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.core.speculation import NgramDrafter, Speculation
from engine.specs import PolicySpec
from pipeline.config import kv_spec
from servers.worker import EngineWorker
from tests.serving import ONE_SEAT, Server, client, free_port, metric, slow_steps, wait_for

HI = [{"role": "user", "content": "hi"}]


def test_429_with_retry_after(chat_model):
    with Server(*chat_model, PolicySpec.of("static", 8, max_batch=8), max_waiting=1) as s:
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
    w = EngineWorker(SimpleNamespace(scheduler=SimpleNamespace(max_running=4), compiled=False), 16)
    w.measure_step("decode", 0.1, 0)
    w.measure_step("prefill", 0.6, 1000)
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
    with Server(*chat_model, PolicySpec.of("static", 8, max_batch=8)) as s:
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


def test_paged_server_exports_blocks_and_prefix_hits(chat_model):
    """On paged KV, /metrics counts prefix-cache queries and hits in tokens (vLLM's names) and KV usage in blocks:
    the same prompt twice, in turn; the second finds every full block of the first but the one holding its last
    token, and computes only the rest."""
    kv = kv_spec("paged", block_size=4, num_blocks=64)
    with Server(*chat_model, PolicySpec.of("continuous", 2), kv=kv) as s:
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
    from pipeline.measuring.servers import http_cpu_s
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


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_pure_static_never_answers_a_lone_request(chat_model, stream):
    """max_batch 8 and no deadline: a lone request waits forever (seed 000's break-it); leaving dequeues it."""
    with Server(*chat_model, PolicySpec.of("static", 8, max_batch=8), max_waiting=4) as s:
        body = {"messages": HI, "max_tokens": 4, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(10, read=1.0)) as h:
                with h.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
        wait_for(lambda: s.worker.queued() == 0, 5, "the abandoned request stayed in the queue")
        assert metric(s.url, "vllm:request_success_total", finished_reason="abort") == 1


def test_a_speculating_server_serves_64_clients_and_counts_its_drafts(chat_model):
    """Prompt lookup on, 64 seats: the official client at c = 1 and then 64 concurrently, no error; each answer and
    its usage equal the same request's on a server without speculation; vLLM's spec-decode counters add up."""
    prompts = [f"say {w} {w} {w} again and again" for w in ("sea", "sky", "tree", "rock")] * 16
    ask = {"model": "tiny-chat", "max_tokens": 24, "temperature": 0}

    def answers(s, c):
        with ThreadPoolExecutor(c) as pool:
            got = list(pool.map(lambda p: client(s).chat.completions.create(
                messages=[{"role": "user", "content": p}], **ask), prompts[:c] if c == 1 else prompts))
        return [(r.choices[0].message.content, r.usage.completion_tokens, r.usage.prompt_tokens) for r in got]

    spec = Speculation(NgramDrafter(1, 3), 4)
    with Server(*chat_model, PolicySpec.of("continuous", 64), max_waiting=128, speculation=spec) as s:
        fast = answers(s, 1) + answers(s, 64)
        u = s.url
        drafted, accepted = metric(u, "vllm:spec_decode_num_draft_tokens_total"), \
            metric(u, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafted >= accepted > 0 and metric(u, "vllm:spec_decode_num_drafts_total") == spec.num_drafts > 0
        assert metric(u, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert metric(u, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") <= spec.num_drafts
        assert metric(u, "vllm:generation_tokens_total") == sum(n for _, n, _ in fast)
        assert metric(u, "vllm:request_success_total", finished_reason="error") == 0
    with Server(*chat_model, PolicySpec.of("continuous", 64), max_waiting=128) as s:
        assert answers(s, 1) + answers(s, 64) == fast
