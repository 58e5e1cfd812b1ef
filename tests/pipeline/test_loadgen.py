"""The load generator against a stub OpenAI server on loopback: it is never the bottleneck, and it reports
short responses and timeouts as errors instead of waiting forever; the soak counts what a run loses, against the
stub (each kind of loss made on purpose) and against the real server."""
import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.measuring.loadgen import closed_loop, open_loop, poisson, soak
from pipeline.measuring.metrics import summarize
from pipeline.tools.loadgen import main
from tests.serving import BACKENDS, Server, free_port, wait_for


def stub_app(chunks_per_request: int = 8, short_by: int = 0, hang: bool = False, every: int = 0) -> FastAPI:
    """every: if > 0, the every-th request fails in turn: 429, an error event, a stream cut before [DONE], a hang."""
    app = FastAPI()
    count = [0]

    @app.get("/health")
    async def health():
        return {"status": "ok", "rss_mb": 100.0 + count[0]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        count[0] += 1
        fault = (count[0] // every) % 4 if every and count[0] % every == 0 else None
        if fault == 0:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)

        async def gen():
            if hang or fault == 3:
                await asyncio.sleep(3600)
            n = body["max_tokens"] - short_by
            for i in range(n):
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}) + "\n\n"
            if fault == 1:
                yield "data: " + json.dumps({"error": {"message": "boom"}}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
            if fault != 2:
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
        wait_for(lambda: s.started, 30, "the stub server did not start within 30 s")
        servers.append(s)
        return f"http://127.0.0.1:{port}/v1"
    yield start
    for s in servers:
        s.should_exit = True


def test_every_streamed_chunk_is_timed_on_the_test_clock(stub):
    """Every chunk's arrival is timed, and the rate from those times is the rate on the test's own clock (the rate
    itself is printed, not judged: a speed bar has no place in a unit test on a shared machine)."""
    url = stub(chunks_per_request=500)
    t = time.perf_counter()
    recs = asyncio.run(closed_loop(url, "stub", [("hi", 500)] * 32, 16, timeout_s=60, progress=False))
    wall = time.perf_counter() - t
    assert all(r["complete"] and len(r["token_times"]) == r["num_tokens"] == 500 for r in recs) and len(recs) == 32
    timed = 32 * 500 / (max(r["finish"] for r in recs) - min(r["arrival"] for r in recs))  # from the records
    rate = 32 * 500 / wall
    print(f"load generator: {rate:.0f} streamed chunks/s against the stub (stub and client share 2 cores)")
    assert timed == pytest.approx(rate, rel=0.25), (timed, rate)


def test_short_responses_and_timeouts_are_errors(stub):
    short = asyncio.run(closed_loop(stub(chunks_per_request=8, short_by=2), "stub", [("hi", 8)] * 3, 2, 10,
                                    progress=False))
    assert not any(r["complete"] for r in short) and "short response" in short[0]["error"]
    t = time.perf_counter()
    hung = asyncio.run(open_loop(stub(chunks_per_request=8, hang=True), "stub", [("hi", 8)] * 2, [0.0, 0.1], 0.5))
    assert time.perf_counter() - t < 5 and all("timeout" in r["error"] for r in hung)
    s = summarize(__import__("pandas").DataFrame([{**r, "is_long": False} for r in hung]))
    assert s["complete"] == 0 and s["requests"] == 2


def test_soak_counts_every_kind_of_loss(stub):
    """Every 2nd request fails, the kinds in turn: 429, error event, cut stream (lost), hang (past 0.5 s)."""
    url = stub(every=2)
    r = asyncio.run(soak(url, "stub", concurrency=4, duration_s=2.0, max_tokens=4, timeout_s=0.5, warmup=1))
    out = r["outcomes"]
    assert r["requests"] == sum(out.values()) and out["ok"] >= r["requests"] // 2 - 4
    for kind in ("HTTP 429", "error event", "lost", "hung"):
        assert out.get(kind, 0) >= 1, out
    assert r["lost"] == out["lost"] and r["hung"] == out["hung"]
    assert r["rss_mb_start"] > 100 and r["rss_mb_end"] > r["rss_mb_start"]  # the stub's rss counts its requests
    assert r["completed_tokens"] == 4 * out["ok"]


def test_soak_against_the_real_server_loses_nothing(chat_model, capsys):
    with Server(*chat_model, BACKENDS["engine"]) as s:
        r = main(["--url", f"{s.url}/v1", "--model", "tiny-chat", "--concurrency", "4", "--duration", "2",
                  "--max-tokens", "8", "--timeout", "30"])
        assert r["outcomes"] == {"ok": r["requests"]} and r["requests"] >= 4 and r["lost"] == r["hung"] == 0
        assert r["rss_mb_start"] > 10 and r["rss_mb_end"] > 10
        assert json.loads(capsys.readouterr().out) == r


def test_poisson_overload_reports_refusals_and_completed_rate(stub):
    """Every 2nd request fails in turn (429, error event, cut stream, hang past 0.5 s): the run counts each kind, times
    the refusals, and rates only the completed requests."""
    url = stub(every=2)
    r = asyncio.run(poisson(url, "stub", rate=40.0, duration_s=1.0, max_tokens=4, timeout_s=0.5))
    out = r["outcomes"]
    assert r["requests"] == sum(out.values()) >= 20 and r["completed"] == out["ok"]
    assert out.get("HTTP 429", 0) >= 1 and out.get("hung", 0) >= 1 and out.get("lost", 0) >= 1
    assert 0 < r["slowest_refusal_s"]["HTTP 429"] < 0.5
    assert r["completed_per_s"] > 0 and r["completed_tokens_per_s"] == pytest.approx(4 * r["completed_per_s"])
    assert r["health_after"]["status"] == "ok"


def one_shot_server() -> tuple[str, list]:
    """A raw HTTP/1.1 server that keeps each connection open after its (chunked, keep-alive) response but answers
    nothing more on it, closing it 0.2 s later: a server closing idle persistent connections on its own timing, as
    llama.cpp's did. Returns (base URL, connections accepted)."""
    conns, port, ready = [], free_port(), threading.Event()

    async def handle(reader, writer):
        conns.append(1)
        head = await reader.readuntil(b"\r\n\r\n")
        sizes = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        await reader.readexactly(int(sizes[0]))
        events = [b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n', b"data: [DONE]\n\n"]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" +
                     b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        await server.serve_forever()

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    ready.wait(10)
    return f"http://127.0.0.1:{port}/v1", conns


def test_a_connection_the_server_stops_answering_on_is_never_reused():
    """Each request goes out on a connection of its own: a server may close a persistent connection whenever it is
    idle, and a request sent on one it has stopped answering would be lost."""
    url, conns = one_shot_server()
    recs = asyncio.run(closed_loop(url, "stub", [("hi", 1)] * 4, 1, timeout_s=10, progress=False))
    assert [r["outcome"] for r in recs] == ["ok"] * 4 and len(conns) == 4
