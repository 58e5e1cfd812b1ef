"""Soak an OpenAI-compatible server (closed loop for a duration), overload it (--rate: Poisson arrivals), or send it a
workload of conf/ (overrides: its requests at its own arrivals, the same draw as the in-process replay, at --rate):
    python -m pipeline.tools.loadgen --url http://127.0.0.1:8000/v1 --model smollm2-135m --concurrency 16 --duration 600
    python -m pipeline.tools.loadgen --model smollm2-135m --rate 2.5 --duration 60 --max-tokens 32 --timeout 20
    python -m pipeline.tools.loadgen --model smollm2-135m --rate 4 workload=azure-code load=onoff
    python -m pipeline.tools.loadgen --model smollm2-135m workload=trace load=trace load.file=my.csv
"""
import argparse
import asyncio
import json

from pipeline.measuring.loadgen import overload, poisson, soak


def workload_run(a) -> dict:
    """The composed workload's requests (token ids, its output lengths) at its arrivals in seconds, open loop."""
    from pipeline.config import compose_config
    from pipeline.workloads.arrivals import arrival_seconds
    from pipeline.workloads.generate import build, tokenizer_and_vocab

    cfg = compose_config(a.overrides)
    if cfg.load.process == "closed":
        raise SystemExit("load=closed: a closed loop is the soak (--concurrency, --duration, no overrides)")
    wl = build(cfg, *tokenizer_and_vocab(cfg))
    arrivals = arrival_seconds(wl, cfg.load, a.rate)
    reqs = [(list(map(int, p)), int(n)) for p, n in zip(wl["prompt"], wl["output_tokens"])]
    report = asyncio.run(overload(a.url, a.model, reqs, arrivals.tolist(), a.timeout, a.api_key))
    return {"workload": wl.attrs.get("lengths", cfg.workload.name), "load": cfg.load.name, "seed": int(cfg.seed),
            "rate": a.rate, "span_s": float(arrivals[-1]), **report}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Soak an OpenAI-compatible server (closed loop for a duration), "
                                            "overload it (--rate: Poisson arrivals for a duration), or send it a "
                                            "workload of conf/ (overrides) at its own arrivals.")
    p.add_argument("overrides", nargs="*", help="conf/ overrides naming a workload and its arrivals, e.g. "
                                                "workload=azure-code load=onoff model=tiny-chat")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL, ending in /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--duration", type=float, default=None, help="seconds of load after the warm-up (no overrides)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per response (ignore_eos; no overrides)")
    p.add_argument("--timeout", type=float, default=60.0, help="s after which a request counts as hung")
    p.add_argument("--rate", type=float, default=None, help="requests/s, open loop: Poisson without overrides, the "
                                                            "workload's arrivals time-scaled to it with them")
    p.add_argument("--api-key", default=None)
    a = p.parse_args(argv)
    if a.overrides:
        report = workload_run(a)
    elif a.duration is None:
        p.error("--duration is needed for a soak or a Poisson overload (no workload overrides)")
    elif a.rate:
        report = asyncio.run(poisson(a.url, a.model, a.rate, a.duration, max_tokens=a.max_tokens,
                                     timeout_s=a.timeout, api_key=a.api_key))
    else:
        report = asyncio.run(soak(a.url, a.model, a.concurrency, a.duration, max_tokens=a.max_tokens,
                                  timeout_s=a.timeout, api_key=a.api_key))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
