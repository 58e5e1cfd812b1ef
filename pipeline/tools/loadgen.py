"""Soak an OpenAI-compatible server (closed loop for a duration) or overload it (--rate: Poisson arrivals):
    python -m pipeline.tools.loadgen --url http://127.0.0.1:8000/v1 --model smollm2-135m --concurrency 16 --duration 600
    python -m pipeline.tools.loadgen --model smollm2-135m --rate 2.5 --duration 60 --max-tokens 32 --timeout 20
"""
import argparse
import asyncio
import json

from pipeline.measuring.loadgen import poisson, soak


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Soak an OpenAI-compatible server (closed loop for a duration), or "
                                            "overload it (--rate: Poisson arrivals for a duration).")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL, ending in /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--duration", type=float, required=True, help="seconds of load after the warm-up")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per response (ignore_eos)")
    p.add_argument("--timeout", type=float, default=60.0, help="s after which a request counts as hung")
    p.add_argument("--rate", type=float, default=None, help="requests/s, Poisson, open loop (instead of a soak)")
    p.add_argument("--api-key", default=None)
    a = p.parse_args(argv)
    if a.rate:
        report = asyncio.run(poisson(a.url, a.model, a.rate, a.duration, max_tokens=a.max_tokens,
                                     timeout_s=a.timeout, api_key=a.api_key))
    else:
        report = asyncio.run(soak(a.url, a.model, a.concurrency, a.duration, max_tokens=a.max_tokens,
                                  timeout_s=a.timeout, api_key=a.api_key))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
