"""python -m pipeline.tools.hostile [--idle 1000] [--repeats 3] [server overrides]: what a hostile crowd costs the
engine server's other clients. Closed-loop streams (--concurrency, --requests of --max-tokens) are measured alone,
beside the crowd of pipeline/measuring/hostile.py (idle connections, a trickled header, a long stream read a byte a
second) and beside its fair baseline (the same long stream read at full speed), the three in turn --repeats times on
one server; the ratios of the medians of ITL p99, ITL p50, TTFT p50 and throughput, and what the server answered each
hostile connection. Writes reports/hostile.json; exits 1 if a check fails: a 5xx, a hostile connection held past its
bound, a slow reader never dropped, a stream lost, or ITL p99 more than 20 % worse beside the crowd than beside its
baseline."""
import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from collections import Counter

import numpy as np
import pandas as pd

from pipeline.config import ROOT, compose_config
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.hostile import crowd
from pipeline.measuring.loadgen import closed_loop
from pipeline.measuring.metrics import summarize
from pipeline.measuring.servers import requests_for, serve, stop
from pipeline.results import write_json

FIGURES = ("itl_p99_s", "itl_p50_s", "ttft_p50_s", "throughput_tps")
WORSE = 1.2       # the most ITL p99 may grow with the crowd attached
SLACK_S = 3.0     # s: a hostile connection may outlive its bound by this (the event loop's and the crowd's delays)


def streams(url: str, model: str, reqs: list[tuple], concurrency: int) -> dict:
    out = asyncio.run(closed_loop(url, model, reqs, concurrency, 120.0, progress=False))
    s = summarize(pd.DataFrame(out).assign(is_long=False))
    return {**{k: s[k] for k in FIGURES}, "lost": s["requests"] - s["complete"],
            "statuses": dict(Counter(r["outcome"] for r in out))}


ARMS = {"alone": None, "baseline": False, "crowd": True}  # arm: nothing beside, the fair baseline, the crowd


def beside(url: str, model: str, reqs: list[tuple], a, port: int, hostile: bool | None) -> tuple[dict, list]:
    """The measured streams alone (hostile None), or with the crowd (True) or its baseline (False) attached in a
    process of its own, kept attached at least a.crowd_s; returns their figures and the crowd's closed
    connections."""
    if hostile is None:
        return streams(url, model, reqs, a.concurrency), []
    spawn = multiprocessing.get_context("spawn")
    ready, done, results = spawn.Event(), spawn.Event(), spawn.Queue()
    args = (port, a.idle, True, 1.0) if hostile else (port, 0, False, 0.0)
    proc = spawn.Process(target=crowd, args=(*args, ready, done, results), daemon=True)
    proc.start()
    ready.wait(60)
    attached = time.monotonic()
    run = streams(url, model, reqs, a.concurrency)
    time.sleep(max(0.0, a.crowd_s - (time.monotonic() - attached)))  # every bound has had time to act
    done.set()
    closed = results.get(timeout=60)
    proc.join(10)
    return run, closed


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split(": ", 1)[1])
    p.add_argument("overrides", nargs="*", help="the server's conf/ overrides, e.g. policy=chunked")
    p.add_argument("--idle", type=int, default=1000, help="idle connections in the crowd")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8, help="the measured streams in flight")
    p.add_argument("--requests", type=int, default=32, help="measured requests per run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--crowd-s", type=float, default=60.0, help="the least seconds the crowd stays attached each time")
    p.add_argument("--out", default=str(ROOT / "reports" / "hostile.json"))
    a = p.parse_args(argv)
    cfg = compose_config(a.overrides)
    server, port = serve(a.overrides, "hostile")
    url = f"http://127.0.0.1:{port}/v1"
    reqs = requests_for(a.requests, a.max_tokens, int(cfg.seed))
    runs, seen = {arm: [] for arm in ARMS}, []
    try:
        streams(url, cfg.model.name, reqs[:a.concurrency], a.concurrency)  # warm-up
        for i in range(a.repeats):
            for arm, hostile in ARMS.items():
                run, closed = beside(url, cfg.model.name, reqs, a, port, hostile)
                runs[arm].append(run)
                seen += closed if hostile else []
            print(f"repeat {i + 1}: ITL p99 " + ", ".join(f"{runs[arm][-1]['itl_p99_s']:.4f} s {arm}" for arm in ARMS),
                  flush=True)
    finally:
        stop(server)
    out = {"machine": environment(cfg.threads), "model": cfg.model.name, "policy": cfg.policy.name,
           "overrides": a.overrides, "idle": a.idle, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
           "bounds": {k: cfg.server[k] for k in ("read_timeout_s", "send_timeout_s", "max_unread_bytes")},
           "runs": runs, **verdict(runs, seen, cfg.server)}
    write_json(a.out, out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "machine")}, indent=2))
    return out


def verdict(runs: dict, seen: list, srv) -> dict:
    """The crowd's cost as ratios of medians: beside the crowd over beside its baseline (what the hostility costs:
    the bar), and over alone (that and the crowd's one long stream of work besides), what its connections got, and
    the checks."""
    ratio = {f"{k.removesuffix('_s')}_ratio{over}": float(np.median([r[k] for r in runs["crowd"]]) /
                                                           np.median([r[k] for r in runs[arm]]))
             for k in FIGURES for arm, over in (("baseline", ""), ("alone", "_over_alone"))}
    answers = Counter(f"{head or 'nothing'} ({ended})" for head, ended, _ in seen)
    idle = [s for head, _, s in seen if head.startswith("HTTP/1.1 408")]
    dropped = [s for head, ended, s in seen if head.startswith("HTTP/1.1 200") and ended == "reset"]
    checks = {
        "no 5xx": not any(head.startswith("HTTP/1.1 5") for head, _, _ in seen)
        and not any(k.startswith("HTTP 5") for arm in runs for r in runs[arm] for k in r["statuses"]),
        "no measured stream lost": sum(r["lost"] for arm in runs for r in runs[arm]) == 0,
        "idle and trickling connections closed with 408 within read_timeout_s":
            bool(idle) and max(idle) <= srv.read_timeout_s + SLACK_S,
        "every hostile connection answered 408 or dropped": len(idle) + len(dropped) == len(seen),
        "the slow reader reset": bool(dropped),
        f"ITL p99 within {WORSE - 1:.0%} beside the crowd": ratio["itl_p99_ratio"] <= WORSE,
    }
    return {**ratio, "hostile_answers": dict(answers), "idle_closed_after_max_s": max(idle, default=None),
            "slow_reader_dropped_after_s": dropped, "checks": checks, "passed": all(checks.values())}


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
