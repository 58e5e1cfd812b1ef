"""python -m pipeline.tools.fleet hardware=h100-sxm model=llama-3.1-8b-shape precision=bf16-cuda workload=mooncake-conv
    [replicas=4] [multiple=0.8] [routers=round_robin,prefix_aware] [requests=200] [--json]

Computed, never measured: the workload at its published lengths through `replicas` copies of the real engine (chunked
prefill, 256 rows, 2048 tokens a step, each replica's paged K/V and prefix cache as large as its memory holds) on the
spec sheet's roofline, behind each router (engine/router.py; knobs as `router.<knob>=value`: block_tokens,
cache_threshold, balance_abs, balance_rel). The load: `multiple` x what the fleet decodes in full-batch steps of 16
rows a replica (conf/load's ref_seats). One row per router: prefix-cache hit rate, TTFT p50/p99, TPOT p50, throughput,
goodput at conf/slo/chat and the requests each replica served; --json prints one JSON object instead."""
import sys

from omegaconf import OmegaConf

from engine.router import POLICIES, RouterSpec
from pipeline.config import compose_config
from pipeline.measuring.metrics import slo_limits
from pipeline.modeling.batch import paged_pool
from pipeline.modeling.fleet import simulate_fleet
from pipeline.modeling.machines import kv_tokens, spec_roofline
from pipeline.modeling.simulation import full_batch_decode
from pipeline.tools.args import run
from pipeline.workloads.generate import build

OWN = {"replicas", "multiple", "routers", "requests", "tp"}
KNOBS = {"block_tokens": int, "cache_threshold": float, "balance_abs": int, "balance_rel": float}
SEATS, ROWS, BUDGET, CONTEXT = 16, 256, 2048, 32768  # load unit rows; rows a replica runs; tokens a step; a request
VOCAB = 50000


def compute(own: dict, overrides: list[str]) -> dict:
    routers = own.get("routers", ",".join(POLICIES)).split(",")
    knobs = {k.split(".", 1)[1]: v for k, v in own.items() if k.startswith("router.")}
    if unknown := set(knobs) - set(KNOBS):
        raise ValueError(f"unknown router knob(s) {sorted(unknown)}; choose of {sorted(KNOBS)}")
    replicas, multiple = int(own.get("replicas", 4)), float(own.get("multiple", 0.8))
    if replicas < 1 or multiple <= 0:
        raise ValueError(f"replicas={replicas} must be >= 1 and multiple={multiple} > 0")
    cfg = compose_config(["profile=gpu", "slo=chat", "policy=chunked",
                          f"workload.num_requests={int(own.get('requests', 200))}", "profile.requests_scale=1",
                          f"policy.max_running={ROWS}", f"policy.token_budget={BUDGET}",
                          f"max_request_tokens={CONTEXT}", *overrides])
    roof = spec_roofline(cfg, int(own["tp"]) if "tp" in own else None)
    memory = kv_tokens(roof, float(cfg.hardware.memory_gb))
    if memory <= 0:
        raise ValueError(f"{cfg.model.name}'s weights leave no room for K/V on {roof.tp} x {cfg.hardware.name}")
    step_s = roof.step_time(full_batch_decode(SEATS, 64))
    cfg.load.ref_seats, cfg.load.multiple = SEATS, multiple * replicas
    if "scale" in cfg.workload:
        cfg.workload.scale = 1  # a production shape at its published lengths
    wl = build(cfg, None, VOCAB)
    ttft, tpot = slo_limits(cfg.slo, step_s)
    rows = []
    for name in routers:
        spec = RouterSpec(name, cache_tokens=int(memory), **{k: KNOBS[k](v) for k, v in knobs.items()})
        rows.append(simulate_fleet(roof, OmegaConf.to_container(cfg.policy), wl, step_s, CONTEXT, ttft, tpot,
                                   replicas, spec, kv=paged_pool(memory).entry()))
    return {"computed": True, "hardware": cfg.hardware.name, "model": cfg.model.name, "precision": cfg.precision.name,
            "tp": roof.tp, "workload": cfg.workload.name, "requests": len(wl), "replicas": replicas,
            "multiple": multiple, "kv_tokens_per_replica": memory, "ttft_limit_s": ttft, "tpot_limit_s": tpot,
            "rows": rows}


def show(out: dict) -> str:
    lines = [f"computed: {out['requests']} {out['workload']} requests at {out['multiple']:g} x capacity over "
             f"{out['replicas']} x ({out['model']} at {out['precision']} on {out['tp']} x {out['hardware']}); "
             f"SLO TTFT p99 {out['ttft_limit_s']:g} s, TPOT {out['tpot_limit_s'] * 1e3:g} ms",
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
