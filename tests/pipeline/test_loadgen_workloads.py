"""The load generator sends a conf/ workload (token-id prompts, its output lengths) at its own arrivals: against a stub
every request is sent, at the replay's times scaled to the rate, refusals counted; against the engine server an
on/off burst of Azure-code-shaped requests loses nothing, the overload answered 429."""
import threading

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.config import compose_config
from pipeline.tools.loadgen import main
from pipeline.workloads.arrivals import arrival_seconds
from pipeline.workloads.generate import build
from tests.serving import BACKENDS, Server, free_port, wait_for

SHAPE = ["model=tiny-llama", "workload=azure-code", "load=onoff", "workload.num_requests=24"]


def completions_stub(refuse_every: int) -> tuple[FastAPI, list]:
    """Streams max_tokens chunks for a token-id prompt; every refuse_every-th request is answered 429. Returns the app
    and the (prompt length, max_tokens) of each request it got."""
    app, seen = FastAPI(), []

    @app.get("/health")
    async def health():
        return {"status": "ok", "rss_mb": 1.0}

    @app.post("/v1/completions")
    async def completions(body: dict):
        seen.append((len(body["prompt"]), body["max_tokens"]))
        if len(seen) % refuse_every == 0:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"retry-after": "1"})

        async def gen():
            for _ in range(body["max_tokens"]):
                yield 'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
            yield f'data: {{"choices": [], "usage": {{"completion_tokens": {body["max_tokens"]}}}}}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app, seen


@pytest.fixture()
def stub():
    app, seen = completions_stub(refuse_every=5)
    port = free_port()
    s = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=s.run, daemon=True).start()
    wait_for(lambda: s.started, 30, "the stub server did not start within 30 s")
    yield f"http://127.0.0.1:{port}/v1", seen
    s.should_exit = True


def test_a_workload_is_sent_whole_at_its_arrivals(stub):
    url, seen = stub
    r = main(["--url", url, "--model", "stub", "--rate", "200", "--timeout", "10", *SHAPE])
    c = compose_config(SHAPE)
    wl = build(c)
    assert r["requests"] == len(wl) == len(seen) == 18 and r["workload"] == "Azure code lengths / 8"
    assert sorted(seen) == sorted(zip(wl["prompt_tokens"], wl["output_tokens"]))
    assert r["outcomes"] == {"ok": 15, "HTTP 429": 3} and r["completed"] == 15
    assert r["span_s"] == pytest.approx(arrival_seconds(wl, c.load, 200.0)[-1])


def test_a_rate_is_needed_except_for_a_trace(stub, tmp_path):
    """A trace without --rate is replayed on its own timeline x load.time_scale: 4 rows over 8.3 s at 1/100."""
    with pytest.raises(ValueError, match="give a rate"):
        main(["--url", stub[0], "--model", "stub", *SHAPE])
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,30,4\n4.3,20,3\n4.31,12,2\n8.3,5,1\n")
    r = main(["--url", stub[0], "--model", "stub", "model=tiny-llama", "workload=trace", "load=trace",
              f"load.file={f}", "load.time_scale=0.01"])
    assert r["span_s"] == pytest.approx(0.083) and r["requests"] == 4 and r["outcomes"] == {"ok": 4}
    assert sorted(stub[1]) == [(5, 1), (12, 2), (20, 3), (30, 4)]


def test_azure_code_onoff_against_the_engine_server_loses_nothing(chat_model):
    """A burst far above capacity: every request ends ok or refused with 429 at once, none lost, hung or cut."""
    with Server(*chat_model, BACKENDS["engine"], max_waiting=4) as s:
        r = main(["--url", f"{s.url}/v1", "--model", "tiny-chat", "--rate", "400", "--timeout", "60",
                  "model=tiny-chat", "workload=azure-code", "load=onoff", "workload.num_requests=48"])
    out = r["outcomes"]
    print(f"engine server, Azure code / 8, on/off at 400 req/s: {out}, slowest 429 {r['slowest_refusal_s']}")
    assert set(out) == {"ok", "HTTP 429"} and out["ok"] >= 4 and r["requests"] == 36
    assert r["slowest_refusal_s"]["HTTP 429"] < 1.0 and r["health_after"]["status"] == "ok"
