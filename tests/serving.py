"""Test harness for the servers: the app on a real loopback port with a real engine or generate worker, bounded
waits, the official client, slowed steps and Prometheus samples."""
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine import LLMEngine
from engine.factory import build_engine
from engine.model.loader import eos_ids, pad_id
from engine.specs import PolicySpec
from pipeline.config import kv_spec
from servers.app import create_app
from servers.connections import uvicorn_config
from servers.generate_worker import GenerateWorker
from servers.worker import EngineWorker


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


def in_thread(app, read_timeout_s: float = 20.0, send_timeout_s: float = 10.0,
              max_unread_bytes: int = 262144) -> tuple[uvicorn.Server, threading.Thread, str]:
    """An app on a free loopback port in a daemon thread, once it has started: (its server, the thread, its URL)."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, max_connections=2048,
                                           read_timeout_s=read_timeout_s, send_timeout_s=send_timeout_s,
                                           max_unread_bytes=max_unread_bytes, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the test server did not start within 30 s")
    return server, thread, f"http://127.0.0.1:{port}"


class Server:
    """The app on a real loopback port in a thread, for real HTTP clients. policy: an engine policy, or
    {"name": "generate", "max_batch": .., "max_wait_ms": ..} for the HF generate backends."""

    def __init__(self, model, tok, policy, api_key=None, max_waiting=64, max_request_tokens=512, max_queue_wait_s=10.0,
                 kv=kv_spec("slot"), max_body_bytes=4 * 2**20, read_timeout_s=20.0, send_timeout_s=10.0,
                 max_unread_bytes=262144, speculation=None):
        if not isinstance(policy, PolicySpec):  # the HF generate backends
            self.worker = GenerateWorker(model, eos_ids(model), max_request_tokens, policy["max_batch"],
                                         policy["max_wait_ms"], max_waiting, pad_id(tok))
        else:
            self.engine = build_engine(model, policy, max_request_tokens, eos_ids(model), kv=kv,
                                       speculation=speculation)
            self.worker = EngineWorker(self.engine, max_waiting)
        self.worker.start()
        app = create_app(self.worker, tok, "tiny-chat", api_key, default_max_tokens=16,
                         max_queue_wait_s=max_queue_wait_s, max_body_bytes=max_body_bytes)
        self.server, self.thread, self.url = in_thread(app, read_timeout_s=read_timeout_s,
                                                       send_timeout_s=send_timeout_s,
                                                       max_unread_bytes=max_unread_bytes)

    @property
    def port(self) -> int:
        return self.server.config.port

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.worker.stop()


BACKENDS = {"engine": PolicySpec.of("continuous", 4),
            "naive": {"name": "generate", "max_batch": 1, "max_wait_ms": 0},
            "batcher": {"name": "generate", "max_batch": 4, "max_wait_ms": 20}}


def client(s, key="none"):
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0, timeout=30)


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


ONE_SEAT = {"engine": PolicySpec.of("continuous", 1),
            "batcher": {"name": "generate", "max_batch": 1, "max_wait_ms": 0}}


def warming_up(monkeypatch, seconds: float) -> threading.Event:
    """Engines made from now on report compiled steps and warm up (LLMEngine.warm_up) until the returned event is
    set, then report `seconds`; their steps themselves stay eager."""
    release = threading.Event()
    monkeypatch.setattr(LLMEngine, "compiled", property(lambda self: True))
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self: seconds if release.wait(30) else 0.0)
    return release
