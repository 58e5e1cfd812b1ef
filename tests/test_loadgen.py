"""The load generator against a stub OpenAI server on loopback: it is never the bottleneck, and it reports
short responses and timeouts as errors instead of waiting forever."""
import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pipeline.loadgen import closed_loop, open_loop
from pipeline.metrics import summarize
from tests.test_server import free_port


def stub_app(chunks_per_request: int, short_by: int = 0, hang: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        async def gen():
            if hang:
                await asyncio.sleep(3600)
            n = body["max_tokens"] - short_by
            for i in range(n):
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture()
def stub():
    servers = []

    def start(**kw):
        port = free_port()
        s = uvicorn.Server(uvicorn.Config(stub_app(**kw), host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=s.run, daemon=True).start()
        while not s.started:
            time.sleep(0.01)
        servers.append(s)
        return f"http://127.0.0.1:{port}/v1"
    yield start
    for s in servers:
        s.should_exit = True


def test_streamed_chunk_rate(stub):
    url = stub(chunks_per_request=500)
    t = time.perf_counter()
    recs = asyncio.run(closed_loop(url, "stub", [("hi", 500)] * 32, 16, timeout_s=60, progress=False))
    rate = sum(r["num_tokens"] for r in recs) / (time.perf_counter() - t)
    print(f"load generator: {rate:.0f} streamed chunks/s against the stub (stub and client share 2 cores)")
    assert all(r["complete"] for r in recs) and len(recs) == 32


def test_short_responses_and_timeouts_are_errors(stub):
    short = asyncio.run(closed_loop(stub(chunks_per_request=8, short_by=2), "stub", [("hi", 8)] * 3, 2, 10,
                                    progress=False))
    assert not any(r["complete"] for r in short) and "short response" in short[0]["error"]
    t = time.perf_counter()
    hung = asyncio.run(open_loop(stub(chunks_per_request=8, hang=True), "stub", [("hi", 8)] * 2, [0.0, 0.1], 0.5))
    assert time.perf_counter() - t < 5 and all("timeout" in r["error"] for r in hung)
    s = summarize(__import__("pandas").DataFrame([{**r, "is_long": False} for r in hung]))
    assert s["complete"] == 0 and s["requests"] == 2
