"""The OpenAI-compatible server against the official client: streaming and not, bad inputs, 401/404/429/503,
disconnects that free the seat, and greedy output equal to Hugging Face generate."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

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


class Server:
    """The app on a real loopback port in a thread, for real HTTP clients. policy: an engine policy, or
    {"name": "generate", "max_batch": .., "max_wait_ms": ..} for the HF generate backends."""

    def __init__(self, model, tok, policy, api_key=None, max_waiting=64, seat_tokens=512):
        if policy["name"] == "generate":
            self.worker = GenerateWorker(model, eos_ids(model), seat_tokens, policy["max_batch"], policy["max_wait_ms"],
                                         max_waiting)
        else:
            self.engine = LLMEngine(model, policy, seat_tokens, eos_ids(model))
            self.worker = EngineWorker(self.engine, max_waiting)
        self.worker.start()
        self.port = free_port()
        app = create_app(self.worker, tok, "tiny-chat", api_key, default_max_tokens=16)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
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


def test_stop_strings(server, chat_model):
    c = client(server)
    full = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    i = next(i for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].strip())
    stop = full[i:i + 2]
    r = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]


BAD = [
    ("not json", None, 400, "JSON"),
    ({"messages": []}, None, 400, "messages"),
    ({"model": "tiny-chat"}, None, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, None, 400, "512"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, None, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, None, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, None, 400, "n"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, None, 404, "gpt-9"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, None, 400, "seat_tokens = 512"),
]


@pytest.mark.parametrize("body, _, status, text", BAD, ids=[f"{s}-{t}" for _, _, s, t in BAD])
def test_bad_input_gets_its_status_and_message(server, body, _, status, text):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["type"]


def test_api_key(chat_model):
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}, api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert client(s, "sekret").models.list().data[0].id == "tiny-chat"
        assert httpx.get(f"{s.url}/health").status_code == 200  # health needs no key


def test_pure_static_never_answers_a_lone_request(chat_model):
    """max_batch 8 and no deadline: a lone request waits forever (seed 000's break-it); leaving dequeues it."""
    with Server(*chat_model, {"name": "static", "max_seats": 8, "max_batch": 8}, max_waiting=4) as s:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(10, read=1.0)) as h:
                with h.stream("POST", f"{s.url}/v1/chat/completions", json={**body, "stream": True}) as r:
                    for _ in r.iter_lines():
                        pass
        deadline = time.time() + 5
        while s.worker.queued() and time.time() < deadline:
            time.sleep(0.01)
        assert s.worker.queued() == 0


def test_429_with_retry_after(chat_model):
    with Server(*chat_model, {"name": "static", "max_seats": 8, "max_batch": 8}, max_waiting=1) as s:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        def waiter():  # never answered: static waits for 8; its timeout is expected
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=3)
        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        deadline = time.time() + 5
        while s.worker.queued() < 1 and time.time() < deadline:
            time.sleep(0.01)
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and "queue" in r.json()["error"]["message"]


@pytest.mark.parametrize("backend", ["engine", "batcher"])
def test_disconnect_frees_the_seat(chat_model, backend):
    one_seat = {"engine": {"name": "continuous", "max_seats": 1},
                "batcher": {"name": "generate", "max_batch": 1, "max_wait_ms": 0}}
    with Server(*chat_model, one_seat[backend]) as s:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=10) as h:
            with h.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 4:
                        break
        deadline = time.time() + 5
        while s.worker.num_running and time.time() < deadline:
            time.sleep(0.01)
        assert s.worker.num_running == 0
        r = client(s).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3


def test_engine_failure_fails_requests_and_shows_on_health(chat_model):
    with Server(*chat_model, {"name": "continuous", "max_seats": 2}) as s:
        def boom():
            raise RuntimeError("simulated fault")
        s.engine.runner.run = lambda *a, **k: boom()
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=10)
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and "simulated fault" in h.json()["error"]
        assert httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          timeout=10).status_code == 503


def test_metrics_named_like_vllm(server):
    client(server).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:iteration_tokens_total_bucket"):
        assert name in text
