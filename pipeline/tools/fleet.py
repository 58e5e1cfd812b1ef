"""python -m pipeline.tools.fleet hardware=h100-sxm model=llama-3.1-8b-shape precision=bf16-cuda workload=mooncake-conv
    [replicas=4] [split=1P3D] [rate=<req/s> | multiple=0.8] [routers=round_robin,prefix_aware] [requests=200]
    [seconds=10] [latency_s=0.001] [tp=1] [--json]

Computed, never measured: the workload at its published lengths through `replicas` copies of the real engine (chunked
prefill, 256 rows, 2048 tokens a step, each replica's paged K/V and prefix cache as large as its memory holds) on the
spec sheet's roofline, behind each router (engine/router.py; knobs as `router.<knob>=value`: block_tokens,
cache_threshold, balance_abs, balance_rel); `split=PxD` instead runs P prefill and D decode replicas, the K/V handed
over the hardware's interconnect plus `latency_s` (pipeline/modeling/fleet.py). The load: `rate` requests per second,
or `multiple` x what the fleet decodes in full-batch steps of 16 rows a replica; a run has at least `requests`
requests and enough for its arrivals to span `seconds`. One row per router: prefix-cache hit
rate, TTFT p50/p99, TPOT p50, throughput, goodput at conf/slo/chat and the requests each replica served; --json
prints one JSON object instead."""
import sys

from engine.router import POLICIES
from pipeline.modeling.planner import Fleet, Setting, fleet_config, replica_guess
from pipeline.tools.args import run

OWN = {"replicas", "multiple", "rate", "routers", "requests", "seconds", "tp", "split", "latency_s"}
KNOBS = {"block_tokens": int, "cache_threshold": float, "balance_abs": int, "balance_rel": float}


def layout(own: dict) -> tuple[int, float | None]:
    """(replicas, share of them that prefill or None) from replicas= or split=PxD."""
    if "split" not in own:
        return int(own.get("replicas", 4)), None
    p, _, d = own["split"].upper().removesuffix("D").partition("P")
    if not (p.isdigit() and d.isdigit()):
        raise ValueError(f"split={own['split']}: write prefill and decode replicas as <P>P<D>D, e.g. split=1P3D")
    return int(p) + int(d), int(p) / (int(p) + int(d))


def compute(own: dict, overrides: list[str]) -> dict:
    routers = own.get("routers", ",".join(POLICIES)).split(",")
    knobs = {k.split(".", 1)[1]: v for k, v in own.items() if k.startswith("router.")}
    if unknown := set(knobs) - set(KNOBS):
        raise ValueError(f"unknown router knob(s) {sorted(unknown)}; choose of {sorted(KNOBS)}")
    replicas, share = layout(own)
    fleets = [Fleet(replicas, name, share) for name in routers]
    cfg = fleet_config(overrides, int(own.get("requests", 200)))
    setting = Setting(cfg, int(own["tp"]) if "tp" in own else None, float(own.get("latency_s", 1e-3)),
                      tuple((k, KNOBS[k](v)) for k, v in knobs.items()), float(own.get("seconds", 10)))
    multiple = float(own.get("multiple", 0.8))
    rate = float(own["rate"]) if "rate" in own else multiple * replicas * replica_guess(setting)
    if rate <= 0:
        raise ValueError(f"the load must be > 0 (rate={own.get('rate')}, multiple={multiple})")
    rows = [setting.simulate(rate, f) for f in fleets]
    return {"computed": True, "hardware": cfg.hardware.name, "model": cfg.model.name, "precision": cfg.precision.name,
            "tp": setting.roof.tp, "workload": cfg.workload.name, "requests": rows[0]["requests"],
            "replicas": replicas, "rate": rate, "kv_tokens_per_replica": setting.kv_tokens,
            "ttft_limit_s": setting.ttft_s, "tpot_limit_s": setting.tpot_s, "rows": rows}


def show(out: dict) -> str:
    lines = [f"computed: {out['requests']} {out['workload']} requests at {out['rate']:.3g} req/s over "
             f"{out['rows'][0]['split'].replace('colocated', str(out['replicas']) + ' colocated')} x "
             f"({out['model']} at {out['precision']} on {out['tp']} x {out['hardware']}); "
             f"SLO TTFT {out['ttft_limit_s']:g} s, TPOT {out['tpot_limit_s'] * 1e3:g} ms",
             f"{'router':<14}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'tok/s':>9}"
             f"{'goodput':>9}  requests per replica"]
    for r in out["rows"]:
        lines.append(f"{r['router']:<14}{r['prefix_hit_rate']:>9.3f}{r['ttft_p50_s']:>9.3f}s{r['ttft_p99_s']:>9.3f}s"
                     f"{r['tpot_p50_s'] * 1e3:>8.1f}ms{r['throughput_tps']:>9.0f}{r['goodput_tps']:>9.0f}  "
                     f"{r['served']}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    run("fleet", __doc__, argv, OWN, compute, show, ("router.",))


if __name__ == "__main__":
    main(sys.argv[1:])
