"""Load generator for any OpenAI-compatible server: closed loop (c workers) or open loop (saved arrival times),
a soak (closed loop for a duration) that reports what a long run loses, and an overload run (open loop: a workload's
arrivals, or Poisson ones at a rate for a duration) that reports how fast refusals come and what the completed
requests achieve.

Sends at absolute times (never "sleep after send"), streams every response, records one row per request with
the same fields as an engine replay (arrival, first_token, token_times, num_tokens, complete), so
pipeline.measuring.metrics summarizes both. A request that outlives `timeout_s` is recorded incomplete, not waited on.

From the command line: pipeline/tools/loadgen.py.
"""
import asyncio
import json
import time
from collections import Counter

import aiohttp
import numpy as np
from omegaconf import OmegaConf
from tqdm import tqdm

from pipeline.workloads.arrivals import arrival_times


def session(api_key: str | None, limit: int = 0) -> aiohttp.ClientSession:
    """The loads' HTTP client (a bearer token if `api_key`), `limit` connections (0: any number), each request on a
    connection of its own: a server may close an idle persistent connection at any moment, losing a request sent on
    it. aiohttp parses responses in C, leaving more of the CPU the server under test shares."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=limit, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def one(client: aiohttp.ClientSession, url: str, body: dict, t0: float, timeout_s: float,
              cancel_s: float | None = None) -> dict:
    """Send one streaming request; token times are the arrival times of content chunks (s since t0); status: the
    HTTP status (None if none came). outcome: "ok", "HTTP <status>", "error event", "hung" (past timeout_s), "lost"
    (the connection failed or the stream ended without [DONE]) or "cancelled" (its connection closed by this client
    cancel_s after sending, the request still going)."""
    rec = {"arrival": time.perf_counter() - t0, "token_times": [], "num_tokens": 0, "error": None, "outcome": "ok",
           "status": None}
    limit = min(cancel_s or timeout_s, timeout_s)
    try:
        async with asyncio.timeout(limit):
            async with client.post(url, json=body) as r:
                rec["status"] = r.status
                if r.status != 200:
                    rec["error"] = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                    rec["outcome"] = f"HTTP {r.status}"
                    rec["retry_after"] = float(r.headers.get("retry-after", 0) or 0)  # s
                    return rec
                done = False
                async for raw in r.content:  # line by line
                    line = raw.rstrip(b"\r\n")
                    if line == b"data: [DONE]":
                        done = True
                    if not line.startswith(b"data: ") or done:
                        continue
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        rec["error"], rec["outcome"] = msg["error"].get("message"), "error event"
                    elif msg.get("choices"):
                        c = msg["choices"][0]
                        if (c.get("delta") or {}).get("content") or c.get("text"):
                            rec["token_times"].append(time.perf_counter() - t0)
                    if msg.get("usage"):
                        rec["num_tokens"] = msg["usage"]["completion_tokens"]
                if not done and rec["error"] is None:
                    rec["error"], rec["outcome"] = "the stream ended without [DONE]", "lost"
    except TimeoutError:
        rec["error"], rec["outcome"] = ((f"cancelled after {limit:.1f} s", "cancelled") if limit < timeout_s
                                        else (f"timeout after {timeout_s} s", "hung"))
    except aiohttp.ClientError as exc:
        rec["error"], rec["outcome"] = f"{type(exc).__name__}: {exc}", "lost"
    return rec


def finish(rec: dict, want: int | None) -> dict:
    """Fill the derived fields; under ignore_eos a response shorter than asked counts as an error."""
    t = rec["token_times"]
    rec["first_token"] = t[0] if t else None
    rec["finish"] = t[-1] if t else None
    rec["num_tokens"] = rec["num_tokens"] or len(t)
    if rec["error"] is None and want is not None and rec["num_tokens"] < want:
        rec["error"], rec["outcome"] = f"short response: {rec['num_tokens']} of {want} tokens", "lost"
    rec["complete"] = rec["error"] is None and bool(t)
    return rec


def body_for(model: str, prompt, max_tokens: int, ignore_eos: bool) -> dict:
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if isinstance(prompt, str):
        return {**base, "messages": [{"role": "user", "content": prompt}]}
    return {**base, "prompt": list(prompt)}


async def closed_loop(base_url: str, model: str, requests: list[tuple], concurrency: int, timeout_s: float,
                      api_key: str | None = None, ignore_eos: bool = True, progress: bool = True) -> list[dict]:
    """`concurrency` workers; each sends its next request when its last one ends. requests: (prompt, max_tokens)."""
    url = endpoint(base_url, requests[0][0])
    todo = list(enumerate(requests))
    out: list[dict] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc=f"c={concurrency}", disable=not progress, leave=False)
    async with session(api_key, concurrency + 4) as client:
        t0 = time.perf_counter()

        async def worker():
            while todo:
                i, (prompt, n) = todo.pop(0)
                out[i] = finish(await one(client, url, body_for(model, prompt, n, ignore_eos), t0, timeout_s),
                                n if ignore_eos else None)
                bar.update()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    return out


async def open_loop(base_url: str, model: str, requests: list[tuple], arrivals: list[float], timeout_s: float,
                    api_key: str | None = None, ignore_eos: bool = True, users: list[str] | None = None) -> list[dict]:
    """Each request sent at its own absolute time (s from start): Poisson or gamma arrivals from a workload. users:
    each request's OpenAI `user` (a conversation, to a router's session policy)."""
    url = endpoint(base_url, requests[0][0])
    async with session(api_key) as client:
        t0 = time.perf_counter()

        async def at(when: float, prompt, n, user):
            body = body_for(model, prompt, n, ignore_eos) | ({"user": user} if user is not None else {})
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
            return finish(await one(client, url, body, t0, timeout_s), n if ignore_eos else None)

        return list(await asyncio.gather(*(at(a, p, n, u) for a, (p, n), u in
                                           zip(arrivals, requests, users or [None] * len(requests)))))


async def health(client: aiohttp.ClientSession, root: str) -> dict:
    """The server's /health (root: the URL without /v1); {} if it does not answer with JSON."""
    try:
        async with client.get(f"{root}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return json.loads(await r.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


def endpoint(base_url: str, prompt) -> str:
    """The URL for a prompt: chat completions for text, completions for token ids."""
    return base_url.rstrip("/") + ("/chat/completions" if isinstance(prompt, str) else "/completions")


async def soak(base_url: str, model: str, concurrency: int, duration_s: float, prompt="Tell me a story.",
               max_tokens: int = 64, timeout_s: float = 60.0, api_key: str | None = None,
               warmup: int | None = None) -> dict:
    """Closed loop at `concurrency` for duration_s seconds after a warm-up of `warmup` requests (default: one per
    worker); a refused request's worker waits its Retry-After before the next. Returns requests sent, the count of
    each outcome (see one()) and its first error message, lost/hung counts, completed tokens, and the server's
    resident memory (/health rss_mb) after the warm-up and at the end."""
    root = base_url.rstrip("/").removesuffix("/v1")
    url = endpoint(base_url, prompt)
    body = body_for(model, prompt, max_tokens, True)
    async with session(api_key, concurrency + 4) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, url, body, t0, timeout_s) for _ in range(warmup or concurrency)))
        start = await health(client, root)
        outcomes: Counter = Counter()
        first_error: dict[str, str] = {}  # outcome -> its first error message
        tokens = 0
        end = time.perf_counter() + duration_s

        async def worker():
            nonlocal tokens
            while time.perf_counter() < end:
                rec = finish(await one(client, url, body, t0, timeout_s), max_tokens)
                outcomes[rec["outcome"]] += 1
                if rec["error"]:
                    first_error.setdefault(rec["outcome"], rec["error"])
                if rec.get("retry_after"):  # a polite client waits as told before its next request
                    await asyncio.sleep(min(rec["retry_after"], max(0.0, end - time.perf_counter())))
                tokens += rec["num_tokens"] if rec["complete"] else 0

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stop = await health(client, root)
    return {"requests": sum(outcomes.values()), "outcomes": dict(outcomes), "first_error": first_error,
            "lost": outcomes["lost"], "hung": outcomes["hung"], "completed_tokens": tokens, "duration_s": duration_s,
            "concurrency": concurrency, "rss_mb_start": start.get("rss_mb"), "rss_mb_end": stop.get("rss_mb")}


def open_loop_times(load, rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Send times (s) before duration_s of `load`'s arrival process (pipeline.workloads.arrivals) at `rate`
    requests/s, drawn from `seed` as every open loop draws them."""
    times = arrival_times(np.random.default_rng(seed), int(rate * duration_s * 2) + 16, load, rate)
    return [float(t) for t in times if t < duration_s]


async def overload(base_url: str, model: str, requests: list[tuple], arrivals: list[float], timeout_s: float = 20.0,
                   api_key: str | None = None, ignore_eos: bool = True) -> dict:
    """Open loop: request i, (prompt, max_tokens), sent at arrivals[i] s, each client waiting timeout_s. Returns the
    count of each outcome, per refusal status the slowest answer (s from send to the answer's end), completed
    requests and their tokens per second (from the start to the last token), and /health once every answer is in."""
    root = base_url.rstrip("/").removesuffix("/v1")
    url = endpoint(base_url, requests[0][0])
    async with session(api_key) as client:
        t0 = time.perf_counter()

        async def at(when: float, prompt, n: int) -> dict:
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
            rec = finish(await one(client, url, body_for(model, prompt, n, ignore_eos), t0, timeout_s),
                         n if ignore_eos else None)
            rec["answered"] = time.perf_counter() - t0 - rec["arrival"]  # s from send to the end of the answer
            return rec

        recs = await asyncio.gather(*(at(a, p, n) for a, (p, n) in zip(arrivals, requests)))
        after = await health(client, root)
    outcomes = Counter(r["outcome"] for r in recs)
    done = [r for r in recs if r["complete"]]
    span = max((r["finish"] for r in done), default=0.0)
    refused = {k: max(r["answered"] for r in recs if r["outcome"] == k) for k in outcomes if k.startswith("HTTP")}
    return {"requests": len(recs), "outcomes": dict(outcomes), "slowest_refusal_s": refused, "completed": len(done),
            "completed_per_s": len(done) / span if span else 0.0,
            "completed_tokens_per_s": sum(r["num_tokens"] for r in done) / span if span else 0.0,
            "health_after": after}


async def poisson(base_url: str, model: str, rate: float, duration_s: float, prompt="Tell me a story.",
                  max_tokens: int = 32, timeout_s: float = 20.0, seed: int = 0, api_key: str | None = None) -> dict:
    """Open loop: Poisson arrivals at `rate` requests/s for duration_s seconds, one prompt and length for all (the
    overload report of overload())."""
    arrivals = open_loop_times(OmegaConf.create({"process": "poisson"}), rate, duration_s, seed)
    report = await overload(base_url, model, [(prompt, max_tokens)] * len(arrivals), arrivals, timeout_s, api_key)
    return {"rate": rate, "duration_s": duration_s, **report}
