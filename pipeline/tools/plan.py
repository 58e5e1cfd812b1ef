"""python -m pipeline.tools.plan hardware=h100-sxm model=llama-3.1-8b-shape workload=azure-conv rate=50 slo=chat
    [precision=bf16-cuda] [routers=least_loaded,prefix_aware] [splits=none,0.5,0.25] [max_running=256]
    [budgets=512,2048] [requests=200] [seconds=10] [usd_per_gpu_hour=2] [tp=1] [latency_s=0.001] [--json]

Computed, never measured: the fewest GPUs that serve the workload at `rate` requests per second (several: rate=10,25,50)
within the SLO (TTFT and TPOT limits met by the SLO's share of the requests), searched over the router, prefill and
decode together (none) or apart (the share of replicas that prefill), max_running and the chunked-prefill token budget
(pipeline/modeling/planner.py: one replica's capacity by bisection on the rate, then the fleet simulated; a run has
at least `requests` requests and enough for its arrivals to span `seconds`). Prints each
configuration at its fewest GPUs, cheapest first, with its capacity per GPU and its cost per million output tokens at
`usd_per_gpu_hour` (your price; 2 is an example), and the best one simulated again with the next seed. --json prints
one JSON object: `plans` (per rate: rate, ranked, best, check) and `best` (the best at the highest rate)."""
import sys

from pipeline.modeling.planner import Setting, fleet_config, grid, plan
from pipeline.tools.args import run

OWN = {"rate", "routers", "splits", "max_running", "budgets", "requests", "seconds", "usd_per_gpu_hour", "tp",
       "latency_s"}


def numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x]


def compute(own: dict, overrides: list[str]) -> dict:
    if "rate" not in own:
        raise ValueError("give the request rate to serve: rate=<req/s> (or several: rate=10,25,50)")
    rates = sorted(numbers(own["rate"]))
    if not rates or rates[0] <= 0:
        raise ValueError(f"rate={own['rate']}: rates must be > 0 req/s")
    cfg = fleet_config(overrides, int(own.get("requests", 200)))
    setting = Setting(cfg, int(own["tp"]) if "tp" in own else None, float(own.get("latency_s", 1e-3)),
                      seconds=float(own.get("seconds", 10)))
    fleets = grid(own.get("routers", "least_loaded,prefix_aware").split(","),
                  [None if s == "none" else float(s) for s in own.get("splits", "none,0.5,0.25").split(",")],
                  numbers(own.get("max_running", "256"), int), numbers(own.get("budgets", "512,2048"), int))
    plans = plan(setting, rates, fleets, float(own.get("usd_per_gpu_hour", 2.0)))
    return {"computed": True, "hardware": cfg.hardware.name, "model": cfg.model.name, "precision": cfg.precision.name,
            "tp": setting.roof.tp, "workload": cfg.workload.name, "seconds": setting.seconds, "slo": cfg.slo.name,
            "ttft_limit_s": setting.ttft_s, "tpot_limit_s": setting.tpot_s, "share": setting.share,
            "usd_per_gpu_hour": float(own.get("usd_per_gpu_hour", 2.0)), "check_seed": int(cfg.seed) + 1,
            "plans": plans, "best": plans[-1]["best"]}


def show(out: dict) -> str:
    lines = [f"computed: {out['model']} at {out['precision']} on {out['hardware']} (tp {out['tp']}), "
             f"{out['workload']} arriving for {out['seconds']:g} s a run; SLO {out['slo']}: TTFT "
             f"{out['ttft_limit_s']:g} s and TPOT {out['tpot_limit_s'] * 1e3:g} ms for {out['share']:.0%} of requests"]
    for p in out["plans"]:
        lines += ["", f"rate {p['rate']:g} req/s", f"{'GPUs':>5}  {'req/s per GPU':>13}  {'$/M out':>8}  "
                  f"{'TTFT p99':>9}  {'TPOT p99':>9}  configuration"]
        for r in p["ranked"]:
            if r["gpus"] is None:
                lines.append(f"{'-':>5}  {'':>13}  {'':>8}  {'':>9}  {'':>9}  {r['config']} (meets nothing)")
                continue
            lines.append(f"{r['gpus']:>5}  {r['capacity_per_gpu']:>13.2f}  {r['usd_per_m_output_tokens']:>8.3f}  "
                         f"{r['ttft_p99_s']:>8.3f}s  {r['tpot_p99_s'] * 1e3:>7.1f}ms  {r['config']}")
        if p.get("check"):
            c = p["check"]
            lines.append(f"best, simulated again with seed {out['check_seed']}: SLO met by {c['slo_met']:.1%} "
                         f"({'meets' if c['meets'] else 'MISSES'} the {out['share']:.0%} share)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    run("plan", __doc__, argv, OWN, compute, show)


if __name__ == "__main__":
    main(sys.argv[1:])
