"""python -m pipeline.tools.soak [--minutes 30] [--concurrency 64] [--cancel 0.2] [server overrides]: the engine
server (python -m servers, policy.max_running = the concurrency unless an override says otherwise) under churn for a
set time: clients arriving in bursts, mixed lengths, random cancels (pipeline/measuring/churn.py). Writes
reports/soak.json (the samples over time, the totals, the checks) and exits 1 if a check fails: a request lost or
hung, a 5xx, resident memory grown by more than 5 % after the warm-up, the server's counters not the clients'."""
import argparse
import asyncio
import json
import sys

from pipeline.config import ROOT, compose_config
from pipeline.measuring.churn import churn
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.servers import serve, stop
from pipeline.results import write_json


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split(": ", 1)[1])
    p.add_argument("overrides", nargs="*", help="the server's conf/ overrides, e.g. model=tiny-chat policy=chunked")
    p.add_argument("--minutes", type=float, default=30.0, help="minutes of churn, the warm-up included")
    p.add_argument("--warmup", type=float, default=3.0, help="minutes of warm-up: memory is compared with its end")
    p.add_argument("--concurrency", type=int, default=64, help="clients")
    p.add_argument("--cancel", type=float, default=0.2, help="share of requests a client cancels")
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--out", default=str(ROOT / "reports" / "soak.json"))
    a = p.parse_args(argv)
    overrides = [f"policy.max_running={a.concurrency}", *a.overrides]
    cfg = compose_config(overrides)  # fails here, with the options listed, on a bad override
    server, port = serve(overrides, "soak")
    try:
        result = asyncio.run(churn(f"http://127.0.0.1:{port}/v1", cfg.model.name, server.pid, a.concurrency,
                                   a.minutes * 60, a.warmup * 60, a.cancel, a.every, seed=int(cfg.seed)))
    finally:
        stop(server)
    out = {"machine": environment(cfg.threads), "model": cfg.model.name, "policy": cfg.policy.name,
           "precision": cfg.precision.name, "overrides": overrides, "minutes": a.minutes, "warmup_minutes": a.warmup,
           "concurrency": a.concurrency, "cancel_share": a.cancel, **result}
    write_json(a.out, out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("series", "machine")}, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
