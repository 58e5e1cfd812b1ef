"""The OpenAI-compatible app: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models,
/health and /metrics. Errors are OpenAI-shaped JSON with the right status.

Admission: a request is refused at once with 429 and Retry-After (integer seconds) when the queue holds
`max_waiting` requests, or when the worker's estimate of its wait to the first token exceeds `max_queue_wait_s`
or the request's own deadline (Retry-After: the estimate's excess over that limit, at least 1 s: the work ahead
clears in real time). While the server drains for shutdown, new requests get 503; so they do while it compiles
its steps before serving (compiled steps on: LLMEngine.warm_up), /health saying "warming up".

A request's deadline is the `x-stainless-read-timeout` header (seconds, a number), which the official OpenAI
SDKs send with every request: the client's read timeout, after which it gives up on a response that has not
started. A request whose first token has not come by then is dropped (aborted, its place in the engine or queue freed)
and answered 408 (an error event when streaming). A client that disconnects, streaming or not, has its request
aborted within one engine step.

Bounds on what a client can make the server do (each in conf/server): a body over `max_body_bytes` gets 413 before
it is read whole; a prompt with more characters than `max_request_tokens` tokens can hold (as many as the longest
token in the vocabulary has) gets 400 before it is tokenized; text that is not valid Unicode (a lone surrogate from a
JSON escape) and a body that is not JSON or too deeply nested get 400. Below the app, servers/connections.py bounds the
connections themselves: the time to send a request, the bytes left unread, their number.

Logprobs are those of the raw model distribution (before penalties, temperature, top-k and top-p), as vLLM and
OpenAI report them; the Hugging Face generate backends refuse logprobs and penalties (400).
"""
import asyncio
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from engine import RequestError, SamplingParams
from engine.usage import rss_mb
from servers.generate_worker import NO_PER_ROW, GenerateWorker
from servers.metrics import ServerMetrics
from servers.middleware import ApiKey, BodyLimit
from servers.protocol import ChatRequest, CompletionRequest, error
from servers.stream import Stream
from servers.worker import EngineWorker

API_FIELDS = {"max_new_tokens": "max_tokens"}                        # engine -> API field (chat: prompt -> messages)
DEADLINE_HEADER = "x-stainless-read-timeout"                           # s the client waits for a response


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (its stored form: byte-level and byte-fallback
    tokens are at least as long as the text they decode to)."""
    return max(len(t) for t in tokenizer.get_vocab())


def create_app(worker: EngineWorker | GenerateWorker, tokenizer, model_name: str, api_key: str | None = None,
               default_max_tokens: int = 256, max_queue_wait_s: float = 10.0,
               max_body_bytes: int = 4 * 2**20) -> FastAPI:
    app = FastAPI(title="LLM Batching Lab", version="0.1.0")
    metrics = ServerMetrics(model_name)
    worker.on_step = metrics.on_step
    worker.on_speculation = metrics.on_speculation
    eos = set(worker.eos_ids)
    longest = longest_token_chars(tokenizer)  # characters; a prompt over max_request_tokens x this cannot fit

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":  # its loc is a character position, no parameter
            return error(400, "request body is not valid JSON", None)
        param = ".".join(loc) or None
        text = str(first.get("msg", "")).removeprefix("Value error, ")
        return error(400, f"{param or 'body'}: {text}", param)

    @app.exception_handler(HTTPException)
    async def unparsed(_, exc: HTTPException):  # Starlette's: a body it cannot parse (bad UTF-8, nesting), 404, 405
        return error(exc.status_code, f"{exc.detail} (the body must be one JSON object in UTF-8)"
                     if exc.status_code == 400 else str(exc.detail), None, headers=exc.headers)

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)

    def too_long(texts: list[str], field: str) -> JSONResponse | None:
        """400 for text that cannot fit in max_request_tokens tokens, before the tokenizer spends time on it."""
        chars, most = sum(len(t) for t in texts), worker.max_request_tokens * longest
        if chars > most:
            return error(400, f"{field}: {chars} characters cannot fit in max_request_tokens = "
                              f"{worker.max_request_tokens} tokens (at most {most} characters: no token of this model "
                              f"stands for more than {longest})", field)
        return None

    @app.get("/health")
    async def health():
        rss = round(rss_mb(), 1)
        if not worker.alive and not worker.draining:
            return JSONResponse({"status": "down", "error": worker.error, "rss_mb": rss}, status_code=503)
        state = {"running": worker.num_running, "waiting": worker.queued(), "rss_mb": rss,
                 "warm_up_s": round(worker.warm_up_s, 1)}
        if worker.warming:
            return JSONResponse({"status": "warming up", **state}, status_code=503)
        if worker.draining:
            return JSONResponse({"status": "draining", **state}, status_code=503)
        return {"status": "ok", **state}

    @app.get("/metrics")
    async def prom():
        metrics.http_cpu.set(time.thread_time())  # an async handler runs in the event loop's thread
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "lab"}]}

    def deadline_of(request: Request) -> float | None:
        """The client's deadline in seconds from now, from its header; None if it sent none or not a number."""
        try:
            s = float(request.headers.get(DEADLINE_HEADER, ""))
        except ValueError:
            return None
        return s if s > 0 and math.isfinite(s) else None

    def admit(prompt: list[int], max_tokens: int, deadline: float | None) -> JSONResponse | None:
        if worker.draining:
            return error(503, "the server is shutting down; retry on another replica", None, "server_error")
        if not worker.alive:
            return error(503, "the engine is down; see /health", None, "server_error")
        if worker.warming:
            return error(503, "the server is compiling its steps (warming up); retry when /health says ok", None,
                         "server_error", headers={"Retry-After": "5"})
        if worker.queued() >= worker.max_waiting:
            return error(429, f"the waiting queue is full ({worker.max_waiting} requests); retry shortly", None,
                         "rate_limit_error", headers={"Retry-After": "1"})
        wait = worker.wait_estimate(len(prompt), max_tokens)
        limit = min(max_queue_wait_s, deadline or math.inf)
        if wait > limit:
            retry = max(1, math.ceil(wait - limit))
            return error(429, f"overloaded: the estimated wait to the first token is {wait:.1f} s, over the "
                              f"{limit:g} s allowed; retry in {retry} s", None, "rate_limit_error",
                         headers={"Retry-After": str(retry)})
        return None

    def params_of(body, max_tokens: int) -> SamplingParams:
        def given(v, default):
            return default if v is None else v

        return SamplingParams(max_new_tokens=max_tokens, temperature=given(body.temperature, 1.0),
                             top_p=given(body.top_p, 1.0), top_k=max(0, given(body.top_k, 0)), seed=body.seed,
                             ignore_eos=bool(body.ignore_eos), presence_penalty=given(body.presence_penalty, 0.0),
                             frequency_penalty=given(body.frequency_penalty, 0.0),
                             repetition_penalty=given(body.repetition_penalty, 1.0), logprobs=body.logprobs_k)

    async def serve(request: Request, body, prompt: list[int], chat: bool, max_tokens: int | None):
        if body.model not in (None, model_name):
            return error(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                         code="model_not_found")
        params = params_of(body, max_tokens or default_max_tokens)
        if isinstance(worker, GenerateWorker):
            asked = [f for f in NO_PER_ROW if getattr(params, f) != getattr(SamplingParams, f)]
            if asked:
                return error(400, f"{asked[0]}: not supported by the Hugging Face generate backends (one sampling "
                                  "setting per batch); use server=engine", asked[0])
        try:
            worker.validate(prompt, params)
        except RequestError as exc:
            field = "messages" if chat and exc.field == "prompt" else API_FIELDS.get(exc.field, exc.field)
            return error(400, str(exc).replace("max_new_tokens", "max_tokens"), field)
        deadline = deadline_of(request)
        refused = admit(prompt, params.max_new_tokens, deadline)
        if refused:
            return refused
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        arrival = time.perf_counter()
        worker.submit(rid, prompt, params, loop, q)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stream = Stream(rid, prompt, chat, body, tokenizer, stop, eos, q, worker, metrics, arrival, model_name,
                        None if deadline is None else arrival + deadline)
        if body.stream:
            return StreamingResponse(stream.sse(), media_type="text/event-stream")
        return await stream.whole(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest):
        msgs = [m.text() for m in body.messages]
        if refused := too_long([m["content"] for m in msgs], "messages"):
            return refused
        prompt = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        return await serve(request, body, prompt, True, body.max_completion_tokens or body.max_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        if isinstance(body.prompt, str) and (refused := too_long([body.prompt], "prompt")):
            return refused
        prompt = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        if not prompt:
            return error(400, "prompt: encodes to no tokens", "prompt")
        return await serve(request, body, prompt, False, body.max_tokens)

    return app
