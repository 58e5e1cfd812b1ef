"""The OpenAI-compatible server against the official client and load testers' request bodies: streaming and not,
content parts, logprobs, penalties, bad inputs, 401/404/408/429/503, disconnects that abort the request and free
the seat, backend failures that answer every client, and greedy output equal to Hugging Face generate."""
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
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine import LLMEngine
from engine.loader import eos_ids, load_model
from engine.hf import generate_alone
from servers.app import create_app
from servers.generate_worker import GenerateWorker
from servers.worker import EngineWorker
from tests.conftest import model_cfg


@pytest.fixture(scope="session")
def chat_model(smollm2_tokenizer_dir):
    cfg = model_cfg("tiny-chat")
    cfg.tokenizer = str(smollm2_tokenizer_dir)
    return load_model(cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(ready, timeout_s: float, message: str):
    """Poll `ready()` every 10 ms; fail the test with `message` if it is still false after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.01)


class Server:
    """The app on a real loopback port in a thread, for real HTTP clients. policy: an engine policy, or
    {"name": "generate", "max_batch": .., "max_wait_ms": ..} for the HF generate backends."""

    def __init__(self, model, tok, policy, api_key=None, max_waiting=64, seat_tokens=512, max_queue_wait_s=10.0):
        if policy["name"] == "generate":
            self.worker = GenerateWorker(model, eos_ids(model), seat_tokens, policy["max_batch"], policy["max_wait_ms"],
                                         max_waiting)
        else:
            self.engine = LLMEngine(model, policy, seat_tokens, eos_ids(model))
            self.worker = EngineWorker(self.engine, max_waiting)
        self.worker.start()
        self.port = free_port()
        app = create_app(self.worker, tok, "tiny-chat", api_key, default_max_tokens=16,
                         max_queue_wait_s=max_queue_wait_s)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "the test server did not start within 30 s")
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.worker.stop()


BACKENDS = {"engine": {"name": "continuous", "max_seats": 4},
            "naive": {"name": "generate", "max_batch": 1, "max_wait_ms": 0},
            "batcher": {"name": "generate", "max_batch": 4, "max_wait_ms": 20}}


@pytest.fixture(params=list(BACKENDS))
def any_server(chat_model, request):
    with Server(*chat_model, BACKENDS[request.param]) as s:
        yield s


@pytest.fixture()
def server(chat_model):
    with Server(*chat_model, BACKENDS["engine"]) as s:
        yield s


def client(s, key="none"):
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_chat_and_completions_stream_and_not(any_server):
    c = client(any_server)
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=8, stream=True, temperature=0,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer streamed and not
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    comp = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=5, temperature=0.7, seed=3,
                                extra_body={"ignore_eos": True})
    again = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=5, temperature=0.7, seed=3,
                                 extra_body={"ignore_eos": True})
    assert comp.choices[0].text == again.choices[0].text and comp.usage.completion_tokens == 5
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]


def test_greedy_output_equals_generate(any_server, chat_model):
    model, tok = chat_model
    c = client(any_server)
    for text in ["Hello there", "The capital of France is", "1, 2, 3,"]:
        ids = tok.encode(text)
        ref = generate_alone(model, ids, 12)
        got = c.completions.create(model="tiny-chat", prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
        assert got == tok.decode(ref, skip_special_tokens=True)


def test_stop_strings(any_server):
    c = client(any_server)
    full = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    i = next(i for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].strip())
    stop = full[i:i + 2]
    r = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]
    chunks = list(c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == r.text and chunks[-1].choices[0].finish_reason == "stop"


def test_content_parts_logprobs_and_usage_with_the_openai_client(server, chat_model):
    """Content parts are joined into the prompt; logprobs are the model's own (a forward pass here), the chosen
    token first among the top ones under greedy; continuous usage counts up on every chunk."""
    model, tok = chat_model
    c = client(server)
    parts = [{"type": "text", "text": "The capital"}, {"type": "text", "text": " of France"}]
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": parts}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    plain = c.chat.completions.create(model="tiny-chat", max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
                                      messages=[{"role": "user", "content": "The capital of France"}])
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    lps = r.choices[0].logprobs.content
    assert len(lps) == 4 and all(len(e.top_logprobs) == 3 for e in lps)
    ids = tok.apply_chat_template([{"role": "user", "content": "The capital of France"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        ref = model(torch.tensor([list(ids)])).logits[0, -1].float().log_softmax(-1)
    top = ref.topk(3)
    assert abs(lps[0].logprob - top.values[0].item()) < 1e-3
    assert [e.token for e in lps[0].top_logprobs] == [tok.decode([t]) for t in top.indices.tolist()]
    assert all(e.logprob == e.top_logprobs[0].logprob for e in lps)  # greedy picks the most likely
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": parts}],
                                            max_tokens=5, temperature=0, stream=True, logprobs=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and None not in counts
    assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices and ch.choices[0].logprobs) == 5
    comp = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=3, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0


def test_penalties_change_greedy_output(server):
    """A repetition penalty of 2 (HF's rule) must change a greedy answer that repeats tokens; 1.0 must not."""
    c = client(server)

    def ask(**kw):
        return c.completions.create(model="tiny-chat", prompt="1, 2, 3, 1, 2, 3,", max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, **kw}).choices[0].text

    base = ask()
    assert ask(repetition_penalty=1.0) == base
    assert ask(repetition_penalty=2.0) != base
    assert ask(frequency_penalty=2.0, presence_penalty=2.0) != base


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["guidellm_chat", "guidellm_completions", "vllm_bench_chat",
                                  "vllm_bench_completions"])
def test_load_testers_request_bodies(server, name):
    """The exact bodies guidellm and `vllm bench serve` send: every field taken, streamed text and usage back."""
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.Client(timeout=30) as h, h.stream("POST", server.url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        msgs = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    want = body.get("max_tokens") or body["max_completion_tokens"]
    assert msgs[-1]["usage"]["completion_tokens"] == want and not any("error" in m for m in msgs)
    if body["stream_options"].get("continuous_usage_stats"):
        assert all(m["usage"] for m in msgs)
    else:
        assert all(m["usage"] is None for m in msgs[:-1])
    text = "".join(m["choices"][0].get("text") or m["choices"][0].get("delta", {}).get("content") or ""
                   for m in msgs if m["choices"])
    assert text


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ("not json", None, 400, "JSON"),
    ({"messages": []}, None, 400, "messages"),
    ({"model": "tiny-chat"}, None, 400, "messages"),
    ({"messages": HI, "max_tokens": 0}, None, 400, "max_tokens"),
    ({"messages": HI, "max_tokens": 100000}, None, 400, "512"),
    ({"messages": HI, "temperature": 5}, None, 400, "temperature"),
    ({"messages": HI, "top_p": 0}, None, 400, "top_p"),
    ({"messages": HI, "n": 2}, None, 400, "only n=1"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "role"),
    ({"messages": HI, "model": "gpt-9"}, None, 404, "gpt-9"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, None, 400, "seat_tokens = 512"),
    ({"messages": HI, "stream": "true"}, None, 400, "stream"),
    ({"messages": HI, "temperature": "0.5"}, None, 400, "temperature"),
    ({"messages": HI, "max_tokens": "5"}, None, 400, "max_tokens"),
    ({"messages": HI, "ignore_eos": 1}, None, 400, "ignore_eos"),
    ({"messages": HI, "stream_options": {"include_usage": "yes"}}, None, 400, "include_usage"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400,
     "'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, None, 400,
     "'input_audio' are not supported"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400, "tools"),
    ({"messages": HI, "functions": [{"name": "f"}]}, None, 400, "functions"),
    ({"messages": HI, "response_format": {"type": "json_object"}}, None, 400, "json_object"),
    ({"messages": HI, "top_logprobs": 2}, None, 400, "logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs"),
    ({"messages": HI, "presence_penalty": 3}, None, 400, "presence_penalty"),
    ({"messages": HI, "repetition_penalty": 0}, None, 400, "repetition_penalty"),
]


@pytest.mark.parametrize("body, _, status, text", BAD, ids=[f"{s}-{t}" for _, _, s, t in BAD])
def test_bad_input_gets_its_status_and_message(server, body, _, status, text):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["type"]


BAD_COMPLETIONS = [
    ({"prompt": [1, 2, 49152]}, "[0, 49152)"),
    ({"prompt": [1, -1]}, "[0, 49152)"),
    ({"prompt": []}, "empty list"),
    ({"prompt": ""}, "must not be empty"),
    ({"prompt": 5}, "string or a list of integer token ids"),
    ({"prompt": [1, "2"]}, "string or a list of integer token ids"),
    ({"prompt": [1.0, 2.0]}, "string or a list of integer token ids"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": [[1, 2]]}, "one prompt per request"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "seed": "1"}, "seed"),
    ({"prompt": "hi", "stop": 3}, "stop"),
]


@pytest.mark.parametrize("body, text", BAD_COMPLETIONS, ids=[json.dumps(b) for b, _ in BAD_COMPLETIONS])
def test_bad_completions_input_gets_400_and_message(server, body, text):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert text in r.json()["error"]["message"], r.text


def test_accepted_and_ignored_fields(server):
    body = {"messages": HI, "max_tokens": 2, "user": "u-1", "response_format": {"type": "text"}, "tool_choice": "none",
            "some_vendor_field": {"x": 1}, "temperature": 1, "top_k": -1, "n": 1, "logprobs": False,
            "stop": None, "seed": None, "top_p": None}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("backend", ["naive", "batcher"])
def test_generate_backends_take_the_same_format_and_refuse_per_row_extras(chat_model, backend):
    with Server(*chat_model, BACKENDS[backend]) as s:
        parts = [{"type": "text", "text": "hi"}]
        ok = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                        "max_tokens": 3, "ignore_eos": True, "repetition_penalty": 1.0, "logprobs": False}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        for extra, field in [({"logprobs": True}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
                             ({"repetition_penalty": 1.2}, "repetition_penalty")]:
            r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, **extra}, timeout=10)
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, "stream": "yes"}, timeout=10)
        assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_api_key(chat_model):
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}, api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert client(s, "sekret").models.list().data[0].id == "tiny-chat"
        assert httpx.get(f"{s.url}/health").status_code == 200  # health needs no key


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


def slow_steps(s, delay_s: float):
    """Make every engine step (or generate forward pass) of server `s` take at least delay_s; returns an undo."""
    if hasattr(s, "engine"):
        run = s.engine.runner.run

        def slow(*a, **k):
            time.sleep(delay_s)
            return run(*a, **k)
        s.engine.runner.run = slow
        return lambda: setattr(s.engine.runner, "run", run)
    hook = s.worker.model.register_forward_pre_hook(lambda *a: time.sleep(delay_s))
    return hook.remove


def metric(url: str, name: str, **labels) -> float:
    """The sum of the samples named `name` (with these labels) at url/metrics; 0 if there is none."""
    text = httpx.get(f"{url}/metrics").text
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


ONE_SEAT = {"engine": {"name": "continuous", "max_seats": 1},
            "batcher": {"name": "generate", "max_batch": 1, "max_wait_ms": 0}}


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
