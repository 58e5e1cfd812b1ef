"""Every seed table at GPU scale, computed: the real scheduler on a virtual clock whose steps cost what a spec sheet's
roofline says (pipeline.modeling.roofline), never a measured figure.

Seed 000: the step-time table (its own arithmetic, weights + B x K/V over the bandwidth, beside the calibrated
roofline's step), the seats table, and throughput against TTFT p99 for naive, a static batcher and continuous batching
under closed-loop load. Seed 003: every policy, dynamic timeouts, chunked budgets and the load sweep, on its tables
(conf/experiment) at `SEATS` rows; production shapes at their published lengths under bursty arrivals, and capacity per
GPU at the SLO per policy and shape (the SLO picker). Limits are conf/slo/chat's (TTFT p99 1 s, TPOT p50 100 ms).
"""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from omegaconf import OmegaConf

from engine.specs import KVSpec, PolicySpec
from pipeline.config import compose_config
from pipeline.measuring.metrics import capacity_at_slo, slo_limits
from pipeline.modeling import shaped
from pipeline.modeling.batch import decode_step, paged_pool
from pipeline.modeling.machines import fewest_devices, kv_tokens, spec_roofline
from pipeline.modeling.roofline import GB, Roofline
from pipeline.modeling.simulation import full_batch_decode, simulate
from pipeline.workloads.generate import build
from pipeline.workloads.runs import runs, table_config

SEATS = 16                          # rows every policy holds in seed 003's tables (seed 000's batcher: B = 16)
DEPLOYED = {"static": 16, "dynamic": 16, "continuous": 256, "chunked": 256}  # production shapes: rows as deployed
# (request-level batches the seed's batcher's size, iteration-level vLLM's default max_num_seqs)
TOKEN_BUDGET = 2048                 # chunked prefill's tokens per step at GPU scale (where a table sets none)
CONTEXT = 8192                      # tokens a request may hold (prompt + output)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SEATS_HARDWARE = ("dgx-spark", "rtx-4090", "h100-sxm")
SEATS_MODELS = ("llama-3.1-8b-shape", "llama-3.1-70b-shape")
SEATS_CONTEXTS = (1024, 4096)
CLOSED = {"naive": PolicySpec.of("naive", 1),                           # seed 000's three servers
          "static batcher (B=16, 50 ms)": PolicySpec.of("dynamic", 16, max_batch=16, max_wait_ms=50),
          "continuous (B<=256)": PolicySpec.of("continuous", 256)}
CONCURRENCY = (1, 4, 16, 64, 256)
CLOSED_TOKENS = 128                  # tokens each closed-loop request asks for
SHAPES = ("azure-conv", "azure-code")
SHAPE_POLICIES = ("static", "dynamic", "continuous", "chunked")
LOADS = (0.2, 0.5, 1.0, 1.5, 2.0)
MULTIPLES = (0.01, 0.03, 0.1, 0.3, 1.0)
VOCAB = 50000                        # token ids of the generated prompts (their values cost nothing here)
REQUESTS_SCALE = 1.5                 # x each seed table's requests (profile gpu's scale is 4): stage time
SHAPE_REQUESTS = 96                  # requests a production-shaped run (capacity wants many: stage time)


def base_config(item, seed: int = 0) -> tuple:
    """(the composed config of a `computed` entry at GPU scale, its roofline over the entry's `tp` devices (default:
    the fewest that hold the weights and some K/V), the K/V tokens their memory holds)."""
    scale = REQUESTS_SCALE * float(item.get("requests_scale", 1))  # an entry's requests_scale: fewer for a quick look
    cfg = compose_config([f"hardware={item['hardware']}", f"model={item['model']}", f"precision={item['precision']}",
                          "profile=gpu", f"profile.requests_scale={scale}", "slo=chat",
                          f"max_request_tokens={CONTEXT}", f"seed={seed}"])
    roof = spec_roofline(cfg, int(item.get("tp") or fewest_devices(cfg)))
    return cfg, roof, kv_tokens(roof, float(cfg.hardware.memory_gb))


def at_scale(cfg, base, budget: float, chunk: bool = True, seats: int = SEATS):
    """A run's config at `seats` rows and loads in units of SEATS rows decoding (chunked prefill at TOKEN_BUDGET unless
    `chunk` is False: the run sets its own), the base's requests; iteration-level policies on a paged pool as large as
    the memory holds."""
    cfg.policy.max_running = seats
    cfg.profile.requests_scale = base.profile.requests_scale
    if "max_batch" in cfg.policy:
        cfg.policy.max_batch = seats
    if cfg.policy.name == "chunked" and chunk:
        cfg.policy.token_budget = TOKEN_BUDGET
    cfg.load.ref_seats = SEATS
    if cfg.policy.name not in ("static", "dynamic", "bucketed"):
        cfg.kv = OmegaConf.create(paged_pool(budget).entry())
    return cfg


def job(cfg, wl, step_s: float, concurrency=None) -> tuple:
    """One simulated run as plain values (the config may change after): policy, K/V, context, limits, workload."""
    ttft, tpot = slo_limits(cfg.slo, step_s)
    return (OmegaConf.to_container(cfg.policy), OmegaConf.to_container(cfg.kv), int(cfg.max_request_tokens), ttft,
            tpot, wl, concurrency)


def _simulate(args) -> dict:
    roof, step_s, (policy, kv, context, ttft, tpot, wl, concurrency) = args
    return simulate(roof, policy, wl, step_s, context, ttft, tpot, concurrency, kv=kv)


def run_all(roof: Roofline, step_s: float, jobs: list[tuple]) -> list[dict]:
    """Every job simulated, over the machine's cores (the runs share nothing); summary rows in order."""
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers < 2:
        return [_simulate((roof, step_s, j)) for j in jobs]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_simulate, [(roof, step_s, j) for j in jobs]))


def step_table(roof: Roofline, context: int = 1024) -> list[dict]:
    """Seed 000's table: (weights + B x K/V) / bandwidth at efficiency 1, and the calibrated roofline's step."""
    bw = roof.bandwidth * roof.tp
    weights, kv = roof.weights_bytes() * roof.tp, context * roof.kv_bytes_per_token() * roof.tp
    out = []
    for b in BATCHES:
        ideal = (weights + b * kv) / bw
        step = roof.step_time(decode_step(b, context))
        out.append({"batch": b, "context": context, "weights_gb": weights / GB, "kv_gb": b * kv / GB,
                    "kv_share": b * kv / (weights + b * kv), "ideal_step_s": ideal, "ideal_user_tps": 1 / ideal,
                    "ideal_total_tps": b / ideal, "step_s": step, "user_tps": 1 / step, "total_tps": b / step,
                    "bound": max(roof.parts([(1, context - 1, True)] * b).items(),
                                 key=lambda kv_: kv_[1]["seconds"])[0]})
    return out


def seats_table(item, extra: str) -> list[dict]:
    """Requests that fit at each context, per hardware and model (one device, else the fewest that hold it)."""
    out = []
    for hw in dict.fromkeys((*SEATS_HARDWARE, extra)):
        for model in SEATS_MODELS:
            cfg = compose_config([f"hardware={hw}", f"model={model}", f"precision={item['precision']}"])
            tp = fewest_devices(cfg)
            roof = spec_roofline(cfg, tp)
            tokens = kv_tokens(roof, float(cfg.hardware.memory_gb)) * tp
            out.append({"hardware": hw, "model": model, "devices": tp, "weights_gb": roof.weights_bytes() * tp / GB,
                        "kv_gb": tokens * roof.kv_bytes_per_token() / GB, "kv_tokens": int(tokens),
                        "kv_kib_per_token": roof.kv_bytes_per_token() * tp / 1024,
                        **{f"seats_{c}": int(tokens // c) for c in SEATS_CONTEXTS}})
    return out


def tables(base, roof: Roofline, budget: float, step_s: float) -> dict:
    """All policies, dynamic timeouts and chunked budgets: each run of those seed tables, at scale."""
    meta, jobs = [], []
    for table in ("all_policies", "dynamic_timeouts", "prefill_stall"):
        for name, cfg in runs(base, table):
            cfg = at_scale(cfg, base, budget, chunk="token_budget" not in name)
            meta.append({"table": table, "run": name, "policy": cfg.policy.name,
                         "load_multiple": float(cfg.load.multiple),
                         **{k: cfg.policy[k] for k in ("max_wait_ms", "token_budget") if k in cfg.policy}})
            jobs.append(job(cfg, build(cfg, None, VOCAB), step_s))
    out = {}
    for m, got in zip(meta, run_all(roof, step_s, jobs)):
        out.setdefault(m.pop("table"), []).append({**m, **got})
    return out


def load_sweep(base, roof: Roofline, budget: float, step_s: float) -> list[dict]:
    """Seed 003's load sweep: each headline policy on the all-policies workload at loads 0.2 to 2.0 x capacity."""
    meta, jobs = [], []
    for policy in SHAPE_POLICIES:
        cfg = at_scale(table_config(base, "all_policies", {"policy": policy}), base, budget)
        for m in LOADS:
            cfg.load.multiple = m
            meta.append({"policy": policy, "load_multiple": m})
            jobs.append(job(cfg, build(cfg, None, VOCAB), step_s))
    return [{**m, **got} for m, got in zip(meta, run_all(roof, step_s, jobs))]


def closed_loop(base, roof: Roofline, budget: float, step_s: float) -> list[dict]:
    """Seed 000's picture: each server under c users, each asking for CLOSED_TOKENS tokens once (short chat prompts;
    at least 8 requests, so one user asks 8 times in a row)."""
    cfg = compose_config([f"model={base.model.name}", f"precision={base.precision.name}", "profile=gpu", "slo=chat",
                          "workload=equal", f"workload.output.mean={CLOSED_TOKENS // 4}",
                          f"workload.output.max={CLOSED_TOKENS // 4}",
                          f"max_request_tokens={CONTEXT}", "load=closed", f"seed={base.seed}"])
    meta, jobs = [], []
    for series, policy in CLOSED.items():
        cfg.policy = OmegaConf.create(policy.entry())
        cfg.kv = OmegaConf.create((KVSpec() if policy.name == "dynamic" else paged_pool(budget)).entry())
        for c in CONCURRENCY:
            cfg.workload.num_requests = max(2, c // 4)  # x profile.requests_scale 4
            meta.append({"series": series, "concurrency": c})
            jobs.append(job(cfg, build(cfg, None, VOCAB), step_s, c))
    return [{**m, **got} for m, got in zip(meta, run_all(roof, step_s, jobs))]


def production(base, roof: Roofline, budget: float, step_s: float) -> dict:
    """Every shape at its published lengths (scale 1) under bursty arrivals (gamma, k = 0.25) at each load multiple,
    every policy; capacity per device at the SLO per shape and policy (the SLO picker)."""
    meta, jobs = [], []
    for shape in SHAPES:
        for policy in SHAPE_POLICIES:
            cfg = at_scale(compose_config([f"model={base.model.name}", f"precision={base.precision.name}",
                                           "profile=gpu", "slo=chat", f"workload={shape}", "workload.scale=1",
                                           f"workload.num_requests={SHAPE_REQUESTS / REQUESTS_SCALE:g}",
                                           "load=bursty", "load.burstiness=0.25", f"policy={policy}",
                                           f"max_request_tokens={CONTEXT}", f"seed={base.seed}"]), base,
                           budget, seats=DEPLOYED[policy])
            for m in MULTIPLES:
                cfg.load.multiple = m
                wl = build(cfg, None, VOCAB)
                meta.append({"workload": shape, "lengths": shaped.label(cfg.workload), "multiple": m,
                             "policy": policy, "rate_rps": shaped.rate_rps(cfg, wl, step_s),
                             "clipped": int(wl["clipped"].sum())})
                jobs.append(job(cfg, wl, step_s))
    rows = [{**m, **got} for m, got in zip(meta, run_all(roof, step_s, jobs))]
    ttft, tpot = slo_limits(base.slo, step_s)
    caps = []
    for shape in SHAPES:
        for policy in SHAPE_POLICIES:
            mine = [r for r in rows if r["workload"] == shape and r["policy"] == policy]
            cap = capacity_at_slo(mine, ttft, tpot)
            caps.append({"workload": shape, "policy": policy, "capacity_rps": cap,
                         "capacity_rps_per_device": cap / roof.tp,
                         "output_tps_at_capacity": max((r["throughput_tps"] for r in mine if r["rate_rps"] == cap),
                                                       default=0.0)})
    return {"rows": rows, "capacities": caps, "ttft_limit_s": ttft, "tpot_limit_s": tpot, "deployed": DEPLOYED}


def compute(item, seed: int = 0) -> dict:
    """The whole computed report's figures for one `computed` entry."""
    base, roof, budget = base_config(item, seed)
    step_s = roof.step_time(full_batch_decode(SEATS, 64))
    return {"computed": True, "item": dict(item), "hardware": OmegaConf.to_container(base.hardware),
            "seats": SEATS, "deployed": DEPLOYED, "context_tokens": CONTEXT, "closed_tokens": CLOSED_TOKENS,
            "kv_tokens": budget, "full_batch_step_s": step_s,
            "step_table": step_table(roof), "seats_table": seats_table(item, str(item["hardware"])),
            **tables(base, roof, budget, step_s),
            "load_sweep": load_sweep(base, roof, budget, step_s),
            "closed_loop": closed_loop(base, roof, budget, step_s),
            "production": production(base, roof, budget, step_s)}
