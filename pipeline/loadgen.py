"""Load generator for any OpenAI-compatible server: closed loop (c workers) or open loop (saved arrival times).

Sends at absolute times (never "sleep after send"), streams every response, records one row per request with
the same fields as an engine replay (arrival, first_token, token_times, num_tokens, complete), so
pipeline.metrics summarizes both. A request that outlives `timeout_s` is recorded incomplete, not waited on.
"""
import asyncio
import json
import time

import httpx
from tqdm import tqdm


async def one(client: httpx.AsyncClient, url: str, body: dict, t0: float, timeout_s: float) -> dict:
    """Send one streaming request; token times are the arrival times of content chunks (s since t0)."""
    rec = {"arrival": time.perf_counter() - t0, "token_times": [], "num_tokens": 0, "error": None}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        rec["error"] = msg["error"].get("message")
                    elif msg.get("choices"):
                        c = msg["choices"][0]
                        if (c.get("delta") or {}).get("content") or c.get("text"):
                            rec["token_times"].append(time.perf_counter() - t0)
                    if msg.get("usage"):
                        rec["num_tokens"] = msg["usage"]["completion_tokens"]
    except TimeoutError:
        rec["error"] = f"timeout after {timeout_s} s"
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


def finish(rec: dict, want: int | None) -> dict:
    """Fill the derived fields; under ignore_eos a response shorter than asked counts as an error."""
    t = rec["token_times"]
    rec["first_token"] = t[0] if t else None
    rec["finish"] = t[-1] if t else None
    rec["num_tokens"] = rec["num_tokens"] or len(t)
    if rec["error"] is None and want is not None and rec["num_tokens"] < want:
        rec["error"] = f"short response: {rec['num_tokens']} of {want} tokens"
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
    path = "/chat/completions" if isinstance(requests[0][0], str) else "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo = list(enumerate(requests))
    out: list[dict] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc=f"c={concurrency}", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()

        async def worker():
            while todo:
                i, (prompt, n) = todo.pop(0)
                out[i] = finish(await one(client, path, body_for(model, prompt, n, ignore_eos), t0, timeout_s),
                                n if ignore_eos else None)
                bar.update()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    return out


async def open_loop(base_url: str, model: str, requests: list[tuple], arrivals: list[float], timeout_s: float,
                    api_key: str | None = None, ignore_eos: bool = True) -> list[dict]:
    """Each request sent at its own absolute time (s from start): Poisson or gamma arrivals from a workload."""
    path = "/chat/completions" if isinstance(requests[0][0], str) else "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()

        async def at(when: float, prompt, n):
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
            return finish(await one(client, path, body_for(model, prompt, n, ignore_eos), t0, timeout_s),
                          n if ignore_eos else None)

        return list(await asyncio.gather(*(at(a, p, n) for a, (p, n) in zip(arrivals, requests))))
