"""One request's answer: its tokens as OpenAI chunks (SSE) or one whole response, and how a request that ends
without an answer is told (Failed)."""
import asyncio
import time

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from servers.protocol import error
from servers.text import Detokenizer

FAILURES = {"error": (500, "server_error"), "shutdown": (503, "server_error")}  # finish reason -> status, error type


class Failed(Exception):
    """A request ended without an answer: the HTTP status, error type and message to send."""

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(message)
        self.status, self.error_type, self.message = status, error_type, message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": None, "code": self.status}}


class Stream:
    """One request's tokens as OpenAI chunks or one whole response; aborts the request if the client leaves or
    its deadline passes before the first token."""

    def __init__(self, rid, prompt, chat, body, tokenizer, stop, eos, q, worker, metrics, arrival, model_name,
                 deadline: float | None):
        self.rid, self.prompt, self.chat, self.body, self.model = rid, prompt, chat, body, model_name
        self.tokenizer, self.detok = tokenizer, Detokenizer(tokenizer, stop)
        self.eos, self.q, self.worker, self.metrics, self.arrival = eos, q, worker, metrics, arrival
        self.deadline = deadline                      # time.perf_counter() by which the first token must come
        self.created, self.n, self.last = int(time.time()), 0, None
        self.cached = 0                               # prompt tokens found in the prefix cache
        self.finish: str | None = None
        self.failed = False                           # the worker ended it with an error or shutdown event
        self.lp_entries: list[tuple[int, float, tuple]] = []  # (token, logprob, top) not yet sent

    async def _next(self):
        if self.last is not None or self.deadline is None:
            return await self.q.get()
        try:
            return await asyncio.wait_for(self.q.get(), max(0.0, self.deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            raise Failed(408, "timeout_error", "the request's deadline (x-stainless-read-timeout) passed before "
                                               "its first token; it was dropped") from None

    async def events(self):
        """(text delta, finish reason or None) until the request ends; aborts it if the consumer stops early."""
        try:
            while self.finish is None:
                e = await self._next()
                if e.finish_reason in FAILURES:
                    self.failed = True
                    raise Failed(*FAILURES[e.finish_reason], e.error or e.finish_reason)
                now = time.perf_counter()
                if e.token is not None:
                    self.n, self.cached = self.n + 1, e.cached_tokens
                    (self.metrics.ttft if self.last is None else self.metrics.itl).observe(
                        now - (self.arrival if self.last is None else self.last))
                    self.last = now
                visible = e.token if e.token is not None and (e.token not in self.eos or self.body.ignore_eos) else None
                if visible is not None and e.logprob is not None:
                    self.lp_entries.append((visible, e.logprob, e.top_logprobs))
                text = self.detok.add(visible, final=bool(e.finish_reason))
                if self.detok.stopped:
                    self.finish = "stop"
                    self.worker.abort(self.rid)
                elif e.finish_reason:
                    self.finish = e.finish_reason
                yield text, self.finish
        finally:
            if self.finish is None:  # the request failed, the client went away, or its deadline passed
                self.worker.abort(self.rid)
                reason = "error" if self.failed else "abort"
                self.metrics.finished(reason)
            else:
                self.metrics.e2e.observe(time.perf_counter() - self.arrival)
                self.metrics.finished(self.finish)

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.n,
                "total_tokens": len(self.prompt) + self.n, "prompt_tokens_details": {"cached_tokens": self.cached}}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def logprobs(self, offset: int = 0) -> dict | None:
        """The logprobs of the tokens not yet sent, in the endpoint's format (None if none were asked)."""
        if self.body.logprobs_k is None:
            return None
        entries, self.lp_entries = self.lp_entries, []
        if self.chat:
            def item(t, lp):
                s = self._text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]}
                                for t, lp, top in entries]}
        tokens = [self._text(t) for t, _, _ in entries]
        offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self._text(a): b for a, b in top} for _, _, top in entries],
                "text_offset": offsets}

    def chunk(self, text: str, finish: str | None, first: bool, offset: int) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(), "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(offset), "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    async def sse(self):
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        every = include_usage and opts.continuous_usage_stats  # usage on every chunk (vLLM's extension)
        first, sent = True, 0
        try:
            async for text, finish in self.events():
                if text or finish or first:
                    c = self.chunk(text, finish, first, sent)
                    if include_usage:
                        c["usage"] = self.usage() if every else None
                    yield sse_event(c)
                    first, sent = False, sent + len(text)
        except Failed as exc:
            yield sse_event(exc.body())
        if include_usage:
            tail = {**self.chunk("", None, False, sent), "choices": [], "usage": self.usage()}
            yield sse_event(tail)
        yield b"data: [DONE]\n\n"

    async def _collect(self) -> str:
        return "".join([text async for text, _ in self.events()])

    async def whole(self, request: Request):
        """The whole response; a client that disconnects first has its request aborted (events' finally)."""
        answer = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
            return error(499, "the client disconnected", None)
        try:
            text = answer.result()
        except Failed as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs(),
                      "finish_reason": self.finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(), "finish_reason": self.finish}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}


def sse_event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body is read already, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
