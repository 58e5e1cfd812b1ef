"""The OpenAI-compatible app: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models,
/health and /metrics. Errors are OpenAI-shaped JSON with the right status."""
import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest

from engine import RequestError, SamplingParams
from servers.metrics import ServerMetrics
from servers.protocol import ChatRequest, CompletionRequest, error
from servers.text import Detokenizer
from servers.generate_worker import GenerateWorker
from servers.worker import EngineWorker

FIELD_NAMES = {"max_new_tokens": "max_tokens", "prompt": "messages"}  # engine field -> API field


def create_app(worker: EngineWorker | GenerateWorker, tokenizer, model_name: str, api_key: str | None = None,
               default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="LLM Batching Lab", version="0.1.0")
    metrics = ServerMetrics(model_name)
    worker.on_step = lambda step, events: metrics.on_step(step, worker.num_seats, worker.num_running,
                                                          worker.num_waiting)
    eos = set(worker.eos_ids)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = "request body is not valid JSON" if first.get("type") == "json_invalid" else \
            f"{param or 'body'}: {first.get('msg')}"
        return error(400, msg, param)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(401, "invalid or missing API key (Authorization: Bearer ...)", None,
                             "authentication_error", "invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "down", "error": worker.error}, status_code=503)
        return {"status": "ok", "running": worker.num_running, "waiting": worker.queued()}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "lab"}]}

    def check(body) -> JSONResponse | None:
        if body.model not in (None, model_name):
            return error(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                         code="model_not_found")
        if not worker.alive:
            return error(503, "the engine is down; see /health", None, "server_error")
        if worker.queued() >= worker.max_waiting:
            return error(429, f"the waiting queue is full ({worker.max_waiting} requests); retry shortly", None,
                         "rate_limit_error", headers={"Retry-After": "1"})
        return None

    async def serve(body, prompt: list[int], chat: bool, max_tokens: int | None):
        bad = check(body)
        if bad:
            return bad
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(max_new_tokens=max_tokens or default_max_tokens, temperature=body.temperature,
                                top_p=body.top_p, top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos)
        try:
            worker.validate(prompt, params)
        except RequestError as exc:
            return error(400, str(exc).replace("max_new_tokens", "max_tokens"), FIELD_NAMES.get(exc.field, exc.field))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        arrival = time.perf_counter()
        worker.submit(rid, prompt, params, loop, q)
        stream = Stream(rid, prompt, chat, body, tokenizer, stop, eos, q, worker, metrics, arrival, model_name)
        if body.stream:
            return StreamingResponse(stream.sse(), media_type="text/event-stream")
        return await stream.whole()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        msgs = [m.model_dump() for m in body.messages]
        prompt = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        return await serve(body, prompt, True, body.max_completion_tokens or body.max_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        return await serve(body, prompt, False, body.max_tokens)

    return app


class Stream:
    """One request's tokens as OpenAI chunks or one whole response; aborts the request if the client leaves."""

    def __init__(self, rid, prompt, chat, body, tokenizer, stop, eos, q, worker, metrics, arrival, model_name):
        self.rid, self.prompt, self.chat, self.body, self.model = rid, prompt, chat, body, model_name
        self.detok = Detokenizer(tokenizer, stop)
        self.eos, self.q, self.worker, self.metrics, self.arrival = eos, q, worker, metrics, arrival
        self.created, self.n, self.last = int(time.time()), 0, None
        self.finish: str | None = None

    async def events(self):
        """(text delta, finish reason or None) until the request ends; aborts it if the consumer stops early."""
        try:
            while self.finish is None:
                e = await self.q.get()
                if e.finish_reason and e.finish_reason.startswith("error"):
                    raise RuntimeError(e.finish_reason)
                now = time.perf_counter()
                lab = self.metrics.labels
                if e.token is not None:
                    self.n += 1
                    (self.metrics.ttft if self.last is None else self.metrics.itl).labels(**lab).observe(
                        now - (self.arrival if self.last is None else self.last))
                    self.last = now
                visible = e.token if e.token is not None and (e.token not in self.eos or self.body.ignore_eos) else None
                text = self.detok.add(visible, final=bool(e.finish_reason))
                if self.detok.stopped:
                    self.finish = "stop"
                    self.worker.abort(self.rid)
                elif e.finish_reason:
                    self.finish = e.finish_reason
                yield text, self.finish
        finally:
            if self.finish is None:  # the client went away: free the seat
                self.worker.abort(self.rid)
            else:
                self.metrics.e2e.labels(**self.metrics.labels).observe(time.perf_counter() - self.arrival)
                self.metrics.finished.labels(**self.metrics.labels, finished_reason=self.finish).inc()

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.n,
                "total_tokens": len(self.prompt) + self.n}

    def chunk(self, text: str, finish: str | None, first: bool) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    async def sse(self):
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        first = True
        try:
            async for text, finish in self.events():
                if text or finish or first:
                    c = self.chunk(text, finish, first)
                    if include_usage:
                        c["usage"] = None
                    yield f"data: {json.dumps(c)}\n\n"
                    first = False
        except RuntimeError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
        if include_usage:
            tail = {**self.chunk("", None, False), "choices": [], "usage": self.usage()}
            yield f"data: {json.dumps(tail)}\n\n"
        yield "data: [DONE]\n\n"

    async def whole(self):
        parts = []
        try:
            async for text, _ in self.events():
                parts.append(text)
        except RuntimeError as exc:
            return error(500, str(exc), None, "server_error")
        text = "".join(parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}
