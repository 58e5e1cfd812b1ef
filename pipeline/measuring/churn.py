"""Churn against a lab server process: `concurrency` clients in a closed loop that arrive in bursts (each pauses a
think time drawn from a gamma of CV 2, short in a burst and long between bursts), ask for mixed prompt and answer
lengths, and cancel `cancel_share` of their requests at a random moment (queued, or mid-stream); every `every_s`
seconds a sample of the server process (resident memory, threads, open files) and of the clients (requests in
flight, outcomes, TTFT); and the verdict: nothing lost or hung, no 5xx, memory within 5 % of its value after the
warm-up, and the server's request counters equal to the clients'."""
import asyncio
import time
from collections import Counter

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from engine.usage import held
from pipeline.measuring.loadgen import endpoint, one, session
from pipeline.measuring.metrics import pct
from pipeline.workloads.prompts import CHAT

PERIOD_S, BURST_S = 60.0, 15.0   # s: a burst of BURST_S every PERIOD_S
THINK_S = (2.0, 0.05)            # s: mean think time between bursts, in a burst
LENGTHS = (8, 32, 128, 256)      # max_tokens, drawn evenly
REPEATS = (1, 4, 16)             # times the prompt's text is repeated: about 20 to 400 tokens
CANCEL_S = 10.0                  # s: a cancel comes uniformly within this of the send
GROWTH = 1.05                    # the most resident memory may grow over its value after the warm-up
FINISHED = "vllm:request_success_total"


async def finished(client, root: str) -> Counter:
    """The server's finished requests by reason (its vllm:request_success_total)."""
    async with client.get(f"{root}/metrics") as r:
        text = await r.text()
    return Counter({smp.labels["finished_reason"]: smp.value for fam in text_string_to_metric_families(text)
                    for smp in fam.samples if smp.name == FINISHED})


async def churn(base_url: str, model: str, pid: int, concurrency: int, duration_s: float, warmup_s: float,
                cancel_share: float = 0.2, every_s: float = 10.0, timeout_s: float = 300.0, seed: int = 0) -> dict:
    """Run the churn for duration_s (the first warmup_s of it the warm-up); returns the samples, the totals and the
    verdict (see the module)."""
    root, url = base_url.rstrip("/").removesuffix("/v1"), endpoint(base_url, "text")
    recs: list[dict] = []
    in_flight = 0
    async with session(None, concurrency + 8) as client:
        before = await finished(client, root)
        t0 = time.perf_counter()

        async def client_loop(i: int):
            nonlocal in_flight
            rng = np.random.default_rng([seed, i])  # each client its own draws
            while True:
                burst = (time.perf_counter() - t0) % PERIOD_S < BURST_S
                await asyncio.sleep(rng.gamma(0.25, THINK_S[burst] / 0.25))  # shape 1/CV^2 = 0.25
                if time.perf_counter() - t0 >= duration_s:
                    return
                text = " ".join([CHAT[rng.integers(len(CHAT))]] * int(rng.choice(REPEATS)))
                body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
                        "max_tokens": int(rng.choice(LENGTHS)), "stream": True}
                cancel = float(rng.uniform(0, CANCEL_S)) if rng.random() < cancel_share else None
                in_flight += 1
                recs.append(await one(client, url, body, t0, timeout_s, cancel))
                in_flight -= 1

        async def sampler() -> list[dict]:
            rows, seen = [], 0
            while (now := time.perf_counter() - t0) < duration_s + timeout_s and (now < duration_s or in_flight):
                await asyncio.sleep(every_s)
                window, seen = recs[seen:], len(recs)
                ttft = [r["token_times"][0] - r["arrival"] for r in window if r["token_times"]]
                outcomes = Counter(r["outcome"] for r in window)
                rows.append({"t_s": round(time.perf_counter() - t0, 1), **held(pid), "in_flight": in_flight,
                             **{k: outcomes[k] for k in ("ok", "cancelled", "lost", "hung", "error event")},
                             "refused": sum(v for k, v in outcomes.items() if k.startswith("HTTP")),
                             "ttft_p50_s": pct(ttft, 50) if ttft else None,
                             "ttft_p99_s": pct(ttft, 99) if ttft else None})
            return rows

        series, *_ = await asyncio.gather(sampler(), *(client_loop(i) for i in range(concurrency)))
        after = await finished(client, root)
    return {"series": series, **verdict(recs, series, after - before, warmup_s)}


def verdict(recs: list[dict], series: list[dict], server: Counter, warmup_s: float) -> dict:
    """Totals and checks. A request answered 200 is one the server counts once when it ends (stop, length, abort or
    error); one cancelled before its answer may or may not have reached it; one cancelled mid-stream may have
    finished on the server first."""
    outcomes = Counter(r["outcome"] for r in recs)
    answered = sum(r["status"] == 200 for r in recs)
    early = sum(r["outcome"] == "cancelled" and r["status"] is None for r in recs)
    late = outcomes["cancelled"] - early
    done = server["stop"] + server["length"]
    warm = next((s for s in series if s["t_s"] >= warmup_s), series[-1])
    end = float(np.median([s["rss_mb"] for s in series[-3:]]))
    checks = {
        "nothing lost or hung": outcomes["lost"] + outcomes["hung"] == 0,
        "no 5xx": not any(r["status"] and r["status"] >= 500 for r in recs),
        "no error events": outcomes["error event"] == 0 and server["error"] == 0,
        f"resident memory within {GROWTH - 1:.0%} of its value after the warm-up": end <= GROWTH * warm["rss_mb"],
        "the server's counts match the clients'": answered <= sum(server.values()) <= answered + early
        and outcomes["ok"] <= done <= outcomes["ok"] + late,
    }
    return {"requests": len(recs), "outcomes": dict(outcomes), "answered": answered,
            "cancelled_before_answer": early, "server_finished": dict(server),
            "rss_mb_after_warmup": warm["rss_mb"], "rss_mb_end": end, "rss_growth_ratio": end / warm["rss_mb"],
            "threads_after_warmup": warm["threads"], "threads_end": series[-1]["threads"],
            "open_files_after_warmup": warm["open_files"], "open_files_end": series[-1]["open_files"],
            "checks": checks, "passed": all(checks.values())}
