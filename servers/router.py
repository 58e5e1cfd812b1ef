"""The routing server: one OpenAI-compatible endpoint in front of N engine servers (conf/server/router.yaml), each
request sent to the replica that engine.router's policy picks (the same Router the fleet simulator runs), its
response passed back as it comes, streamed or whole.

What the router reads of a request: its prompt (token ids as sent, else text: a prompt string, or a chat's messages
as role and content; the prefix index and the load then count characters, as SGLang's router does), its
max_completion_tokens or max_tokens (else default_max_tokens) and its session (the `session_header` header, else the
body's `user`). Everything else is the replica's to check: its 400s, 404s, 413s and 429s (with Retry-After) come back
as it sent them.

Health: every `health_interval_s` each replica's /health; one that does not answer 200 (down, draining, warming up)
is skipped until it does. A request whose replica cannot be reached or answers 503 goes to the next replica the
policy picks among those not tried (nothing of it was served); when none is left, 503. A replica lost mid-stream
ends that stream with an error event.
"""
import asyncio
import contextlib
import json
import uuid

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from engine.router import Router, RouterSpec
from servers.middleware import ApiKey, BodyLimit
from servers.protocol import error

FORWARD = ("authorization", "content-type", "accept", "x-stainless-read-timeout")  # request headers passed on
RETURNED = ("content-type", "retry-after")                                          # response headers passed back


def routed_prompt(body: dict):
    """What the router indexes: the prompt's token ids, or its text (a chat: each message's role and content)."""
    if "messages" in body:
        msgs = body["messages"] if isinstance(body["messages"], list) else []
        return "".join(f"{m.get('role')}\n{text_of(m.get('content'))}\n" for m in msgs if isinstance(m, dict))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def text_of(content) -> str:
    """A message's content as text: a string, or the text of its parts."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def asked_tokens(body: dict, default: int) -> int:
    """The tokens the request may generate (for the load it puts on its replica)."""
    n = body.get("max_completion_tokens") or body.get("max_tokens")
    return n if type(n) is int and n > 0 else default


class Metrics:
    """The router's Prometheus metrics: requests by replica and status, retries, each replica's health and load."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lab:router_requests", "Requests answered, by replica and HTTP status.",
                                ["replica", "status"], registry=r)
        self.retries = Counter("lab:router_retries", "Requests sent on to another replica (unreachable or 503).",
                               ["replica"], registry=r)
        self.up = Gauge("lab:router_replica_up", "1 if the replica's /health answers 200.", ["replica"], registry=r)
        self.outstanding = Gauge("lab:router_outstanding_requests", "Requests routed to the replica and not ended.",
                                 ["replica"], registry=r)


def create_router_app(backends: list[str], spec: RouterSpec, default_max_tokens: int = 256,
                      session_header: str = "x-session-id", health_interval_s: float = 1.0,
                      health_timeout_s: float = 2.0, api_key: str | None = None,
                      max_body_bytes: int = 4 * 2**20) -> FastAPI:
    urls = [b.rstrip("/").removesuffix("/v1") for b in backends]
    if not urls:
        raise ValueError("the router needs at least one backend: server.backends=[http://127.0.0.1:8001,...]")
    router, metrics = Router(spec, len(urls)), Metrics()
    state: dict = {}

    def mark(i: int, up: bool) -> None:
        (router.down.discard if up else router.down.add)(i)
        metrics.up.labels(urls[i]).set(int(up))

    async def check(i: int) -> None:
        try:
            async with state["client"].get(f"{urls[i]}/health",
                                           timeout=aiohttp.ClientTimeout(total=health_timeout_s)) as r:
                mark(i, r.status == 200)
        except (aiohttp.ClientError, OSError, TimeoutError):
            mark(i, False)

    async def watch() -> None:
        while True:
            await asyncio.sleep(health_interval_s)
            await asyncio.gather(*(check(i) for i in range(len(urls))))

    @contextlib.asynccontextmanager
    async def lifespan(_):
        # a fresh connection per request: a replica may close an idle kept-alive one as a request is sent on it
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=None, sock_connect=health_timeout_s),
                                         auto_decompress=False) as client:
            state["client"] = client
            await asyncio.gather(*(check(i) for i in range(len(urls))))
            task = asyncio.create_task(watch())
            yield
            task.cancel()

    app = FastAPI(title="LLM Batching Lab router", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)

    @app.get("/health")
    async def health():
        replicas = [{"url": u, "up": i not in router.down, "outstanding": router.requests[i]}
                    for i, u in enumerate(urls)]
        up = any(r["up"] for r in replicas)
        return JSONResponse({"status": "ok" if up else "down", "policy": spec.policy, "replicas": replicas},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def prom():
        for i, u in enumerate(urls):
            metrics.outstanding.labels(u).set(router.requests[i])
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        for i in (i for i in range(len(urls)) if i not in router.down):
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with state["client"].get(f"{urls[i]}/v1/models", headers=passed(request)) as r:
                    return Response(await r.read(), r.status, headers=returned(r))
        return error(503, "no replica is up; see /health", None, "server_error")

    def passed(request: Request) -> dict:
        return {k: v for k in FORWARD if (v := request.headers.get(k)) is not None}

    def returned(r: aiohttp.ClientResponse) -> dict:
        return {k: v for k in RETURNED if (v := r.headers.get(k)) is not None}

    async def forward(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return error(400, "request body is not valid JSON", None)
        if not isinstance(body, dict):
            return error(400, "the body must be one JSON object", None)
        prompt, tokens = routed_prompt(body), asked_tokens(body, default_max_tokens)
        session = request.headers.get(session_header) or (body["user"] if isinstance(body.get("user"), str) else None)
        tried, refused = set(), None
        while True:
            rid = uuid.uuid4().hex
            try:
                to = router.route(rid, prompt, tokens, session, skip=tried)
            except LookupError as exc:
                return refused or error(503, f"no replica can take the request ({exc}); see /health", None,
                                        "server_error", headers={"Retry-After": "1"})
            try:
                r = await state["client"].post(f"{urls[to]}{path}", data=raw, headers=passed(request))
            except (aiohttp.ClientError, OSError):
                r = None
            if r is None or r.status == 503:  # not served there: the next replica
                if r is not None:
                    refused = Response(await r.read(), 503, headers=returned(r))
                    r.release()
                router.finished(rid)
                mark(to, False)
                metrics.retries.labels(urls[to]).inc()
                tried.add(to)
                continue
            metrics.requests.labels(urls[to], str(r.status)).inc()
            if r.status != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
                try:
                    return Response(await r.read(), r.status, headers=returned(r))
                except (aiohttp.ClientError, OSError):
                    mark(to, False)
                    return error(502, f"replica {urls[to]} failed while answering", None, "server_error")
                finally:
                    r.release()
                    router.finished(rid)
            return StreamingResponse(relay(r, rid, to), headers=returned(r))

    async def relay(r: aiohttp.ClientResponse, rid: str, to: int):
        """The replica's stream as it comes; closing it (the client went away) closes the replica's, which aborts."""
        try:
            async for chunk in r.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError):
            mark(to, False)
            lost = {"error": {"message": f"replica {urls[to]} failed mid-response", "type": "server_error",
                              "param": None, "code": None}}
            yield f"data: {json.dumps(lost)}\n\ndata: [DONE]\n\n".encode()
        finally:
            r.close()
            router.finished(rid)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    return app
