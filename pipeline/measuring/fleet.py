"""A fleet measured on this machine (stage bench_fleet, bench.fleet): `replicas` engine servers of threads / replicas
threads each behind the routing server (servers/router.py), under every router policy, against one engine server of
all `threads`, on each workload; the fleet simulator (pipeline.modeling.fleet) predicting every run beside it.

- Requests: each workload's (production-shaped, at its `scale`; its `overrides`), Poisson arrivals at its `load` x the
  rate at which the replicas serve its requests one at a time (the cost model at their threads), the same arrivals in
  every run. Each
  run's token ids are shifted by its index (modulo the vocabulary): the same lengths and shared prefixes, none found
  in a prefix cache an earlier run filled. A request's `user` is its conversation (its id where it has none).
- Cost models: fitted in this process to the engine's own steps at each thread count (closed-loop replays of the
  first `calibrate` requests of each workload at max_running, after an unrecorded one of WARM_UP requests); the
  simulator runs the same engine policy, paged pool and router on them.
- The router's own cost: TTFT at c = 1 straight to a replica and through the router, request by request in turn: the
  median over pairs of the one through the router over the other.
Every server dies with this process (engine.children)."""
import asyncio
import statistics
import time

import httpx
import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import spearmanr

from engine import threads
from engine.core.kv_blocks import BlockManager
from engine.factory import build_engine
from engine.model.loader import eos_ids
from engine.router import POLICIES, RouterSpec
from pipeline.config import compose_config, kv_spec, policy_spec
from pipeline.measuring.disturbance import Watch
from pipeline.measuring.loadgen import body_for, finish, one, open_loop, session
from pipeline.measuring.metrics import slo_limits, summarize
from pipeline.measuring.replay import replay
from pipeline.measuring.servers import main_step_s, serve_all, stop, unkeyed
from pipeline.modeling.cost_fit import fit
from pipeline.modeling.fleet import simulate_fleet
from pipeline.modeling.planner import unit_s
from pipeline.modeling.simulation import simulate
from pipeline.workloads.generate import build

KEPT = ("requests", "complete", "wall_s", "throughput_tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "slo_met")
SHIFT = 7919  # token ids added per run (a prime), modulo the vocabulary
OVERHEAD_TOKENS = 64  # prompt tokens of the router's cost check (a chat turn)
WARM_UP = 2  # requests replayed unrecorded before the cost models' replays at a thread count


def composed(base, workload: str, spec):
    """The config of one workload's runs: the base's model, precision, profile, SLO and seed; Poisson arrivals; the
    replicas' engine policy on a paged pool; the workload's overrides."""
    top = [f"{g}={base[g].name}" for g in ("model", "precision", "profile", "slo")]
    return compose_config(top + [f"seed={base.seed}", f"max_request_tokens={base.max_request_tokens}",
                                 f"workload={workload}", "load=poisson", f"policy={spec.policy}", "kv=paged",
                                 *spec.workloads[workload].overrides])


def calibrated(net, cfgs: dict, wls: dict, n: int, threads_: int, limits) -> tuple:
    """(cost model, fit stats) of the engine's steps at `threads_` threads on each workload's first n requests."""
    threads.govern(threads_, limits)
    steps = []
    for i, (name, wl) in enumerate(wls.items()):
        cfg = cfgs[name]
        for head in ([WARM_UP, n] if i == 0 else [n]):  # the first run at this thread count pays for set-up
            engine = build_engine(net, policy_spec(cfg.policy), int(cfg.max_request_tokens), eos_ids=eos_ids(net),
                                  kv=kv_spec(cfg.kv))
            got = replay(engine, wl.head(head), 0.0, int(cfg.policy.max_running))[1]
        steps.append(got)
    model, stats = fit(pd.concat(steps, ignore_index=True))
    return model, {"threads": threads_, "steps": stats["steps"], "median_rel_error": stats["median_rel_error"],
                   "p90_rel_error": stats["p90_rel_error"]}


def rate_alone(cost, cfg, wl: pd.DataFrame, replicas: int) -> float:
    """Requests per second `replicas` serve when each serves its requests one at a time (simulated on `cost`)."""
    one = simulate(cost, OmegaConf.to_container(cfg.policy), wl, 1.0, int(cfg.max_request_tokens), float("inf"),
                   float("inf"), concurrency=1, kv=OmegaConf.to_container(cfg.kv))
    return replicas * len(wl) / one["wall_s"]


def shifted(wl: pd.DataFrame, run: int, vocab: int) -> list[list[int]]:
    return [[(int(t) + run * SHIFT) % vocab for t in p] for p in wl["prompt"]]


def counter(url: str, name: str) -> float:
    """A Prometheus counter's total at url/metrics (summed over its labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == f"{name}_total")


def started(overrides: list[list[str]], names: list[str]) -> tuple[list, list[str]]:
    """Lab servers started together (serve_all), none asking for an API key: (processes, base URLs)."""
    procs, ports = serve_all(overrides, names, unkeyed())
    return procs, [f"http://127.0.0.1:{p}" for p in ports]


def engine_args(cfg, threads_: int) -> list[str]:
    return [f"model={cfg.model.name}", f"precision={cfg.precision.name}", f"isa={cfg.isa.name}", "server=engine",
            f"threads={threads_}", f"seed={cfg.seed}", f"policy={cfg.policy.name}", "kv=paged",
            f"server.max_request_tokens={cfg.max_request_tokens}", "server.max_waiting=4096",
            "server.max_queue_wait_s=inf"]


def router_args(policy: str, urls: list[str], cache_tokens: int, seed: int) -> list[str]:
    return ["server=router", f"server.policy={policy}", f"server.backends=[{','.join(urls)}]",
            f"server.cache_tokens={cache_tokens}", f"seed={seed}"]


def one_run(url: str, model: str, wl: pd.DataFrame, prompts, arrivals: list[float], timeout_s: float,
            replicas: list[str], limits: tuple[float, float], measure, pids: list[int]) -> dict:
    """One open-loop run: its summary (KEPT), errors, the prefix-cache hit rate the replicas counted (tokens found
    cached / the workload's prompt tokens), and what other work took meanwhile (pids: the servers, whose CPU is the
    run's own; a disturbed run is labelled, not repeated: the stage's time)."""
    hits0 = sum(counter(r, "vllm:prefix_cache_hits") for r in replicas)
    users = [str(s) for s in (wl["session"] if "session" in wl else wl["rid"])]
    reqs = [(p, int(n)) for p, n in zip(prompts, wl["output_tokens"])]
    with Watch(measure, pids) as watch:
        out = asyncio.run(open_loop(f"{url}/v1", model, reqs, arrivals, timeout_s, users=users))
    hits = sum(counter(r, "vllm:prefix_cache_hits") for r in replicas) - hits0
    s = summarize(pd.DataFrame(out), None, *limits)
    errors = [r["error"] for r in out if r["error"]]
    return {**{k: s[k] for k in KEPT}, "errors": len(errors), "first_error": errors[0] if errors else None,
            "prefix_hit_rate": hits / float(wl["prompt_tokens"].sum()), **watch.result.fields()}


def overhead(model: str, direct: str, routed: str, prompts: list[list[int]], spec) -> dict:
    """TTFT at c = 1 straight to a replica and through the router, one request each way in turn (which goes first
    alternates), `pairs` pairs after one unrecorded pair; a pair's two prompts of one length, none alike: each way's
    median, and the median over pairs of the router's TTFT over the direct one's (what the router adds)."""
    async def pairs() -> list[dict]:
        got = []
        async with session(None, 2) as client:
            for i in range(int(spec.overhead.pairs) + 1):
                ways, pair = [("direct", direct), ("router", routed)][::1 if i % 2 else -1], {}
                for j, (name, url) in enumerate(ways):
                    body = body_for(model, prompts[2 * i + j], int(spec.overhead.max_tokens), True)
                    t0 = time.perf_counter()
                    rec = finish(await one(client, f"{url}/v1/completions", body, t0, 60.0), None)
                    if rec["complete"]:
                        pair[name] = rec["first_token"] - rec["arrival"]
                if i and len(pair) == 2:
                    got.append(pair)
        return got
    got = asyncio.run(pairs())
    return {"direct_ttft_p50_s": statistics.median(p["direct"] for p in got),
            "router_ttft_p50_s": statistics.median(p["router"] for p in got),
            "added": statistics.median(p["router"] / p["direct"] - 1 for p in got), "pairs": len(got)}


class Bench:
    """What every run of the stage shares: each workload's config, requests, arrivals and run indices (its token
    shift), the cost model at each thread count, a replica's pool."""

    def __init__(self, net, tok_vocab: tuple, base):
        self.base, self.spec, self.vocab = base, base.bench.fleet, tok_vocab[1]
        self.replicas, self.threads = int(self.spec.replicas), int(base.threads)
        self.one = max(1, self.threads // self.replicas)  # threads of a replica
        self.cfgs = {w: composed(base, w, self.spec) for w in self.spec.workloads}
        self.wls = {w: build(c, *tok_vocab) for w, c in self.cfgs.items()}
        self.costs = {t: calibrated(net, self.cfgs, self.wls, int(self.spec.calibrate), t, base.measure)
                      for t in sorted({self.one, self.threads})}
        threads.stop(self.threads)
        self.step_s = main_step_s()
        cfg = next(iter(self.cfgs.values()))
        pool = BlockManager.sized(kv_spec(cfg.kv), int(cfg.policy.max_running), int(cfg.max_request_tokens), None)
        self.pool_tokens = pool.num_blocks * pool.block_size  # the router's index: what a replica's pool holds
        self.units = {w: unit_s(wl, float(self.spec.workloads[w].load) * rate_alone(self.costs[self.one][0],
                                                                                    self.cfgs[w], wl, self.replicas))
                      for w, wl in self.wls.items()}  # s per arrival step
        self.index = {(w, p): i * (len(POLICIES) + 1) + j for i, w in enumerate(self.wls)
                      for j, p in enumerate([*POLICIES, None])}  # run -> its token shift (None: one server)

    def run(self, url: str, w: str, policy: str | None, replicas: list[str], pids: list[int]) -> dict:
        """One measured run of workload w (through the router with `policy`, or straight to one server)."""
        wl = self.wls[w]
        got = one_run(url, self.base.model.name, wl, shifted(wl, self.index[w, policy], self.vocab),
                      (wl["arrival_steps"] * self.units[w]).tolist(), float(self.spec.timeout_s), replicas,
                      slo_limits(self.cfgs[w].slo, self.step_s), self.base.measure, pids)
        threads_, reps = (self.one, self.replicas) if policy else (self.threads, 1)
        print(f"{w} {policy or 'one server'}: TTFT p99 {got['ttft_p99_s']:.3f} s, {got['errors']} errors, "
              f"{got['wall_s']:.1f} s", flush=True)
        return {"workload": w, "layout": "fleet" if policy else "one server", "router": policy, "threads": threads_,
                "replicas": reps, **got}

    def runs(self) -> tuple[list[dict], dict]:
        """The replicas and the one server up together (it waits idle until its turn): the router's cost at c = 1,
        every workload under every policy's router, then every workload straight to the one server."""
        cfg, seed = next(iter(self.cfgs.values())), int(self.base.seed)
        procs, urls = started([engine_args(cfg, self.one)] * self.replicas + [engine_args(cfg, self.threads)],
                              [f"replica {i}" for i in range(self.replicas)] + ["one server"])
        (fleet, urls), (alone, url) = (procs[:-1], urls[:-1]), (procs[-1], urls[-1])
        rows = []
        try:
            procs, (routed,) = started([router_args("round_robin", urls[:1], self.pool_tokens, seed)], ["router"])
            try:  # in front of the replica measured straight; the first workload's prompts, cut and shifted
                first, base = next(iter(self.wls.values()))["prompt"].tolist(), len(self.index)
                prompts = [[(int(t) + (base + k) * SHIFT) % self.vocab
                            for t in first[k // 2 % len(first)][:OVERHEAD_TOKENS]]
                           for k in range(2 * int(self.spec.overhead.pairs) + 2)]  # a pair's two alike, none cached
                cost = overhead(self.base.model.name, urls[0], routed, prompts, self.spec)
            finally:
                stop(*procs)
            for w in self.wls:  # a fresh router of each policy per workload, all started together
                procs, routers = started([router_args(p, urls, self.pool_tokens, seed) for p in POLICIES],
                                         [f"router {p}" for p in POLICIES])
                try:
                    for policy, routed in zip(POLICIES, routers):
                        rows.append(self.run(routed, w, policy, urls, [p.pid for p in fleet + procs]))
                finally:
                    stop(*procs)
            stop(*fleet)
            rows += [self.run(url, w, None, [url], [alone.pid]) for w in self.wls]
        finally:
            stop(*[p for p in [*fleet, alone] if p.poll() is None])
        return rows, cost

    def predicted(self, r: dict) -> dict:
        """The fleet simulator's run r (sim_ fields)."""
        wl, cfg = self.wls[r["workload"]], self.cfgs[r["workload"]]
        sim = simulate_fleet(self.costs[r["threads"]][0], OmegaConf.to_container(cfg.policy), wl,
                             self.units[r["workload"]], int(cfg.max_request_tokens),
                             *slo_limits(cfg.slo, self.step_s), r["replicas"],
                             RouterSpec(r["router"] or "round_robin", cache_tokens=self.pool_tokens,
                                        seed=int(self.base.seed)), kv=OmegaConf.to_container(cfg.kv))
        return {f"sim_{k}": sim[k] for k in (*KEPT, "prefix_hit_rate")}


def run_fleet(net, tok_vocab: tuple, base) -> dict:
    """Every measured run and its simulation (bench.fleet); the simulator's agreement on TTFT p99 and p50."""
    b = Bench(net, tok_vocab, base)
    rows, cost = b.runs()
    for r in rows:
        r.update(b.predicted(r))
    return {"rows": rows, "overhead": cost, "agreement": agreement(rows),
            "cost_models": {str(t): {**c[1], "cost_model": c[0].as_dict()} for t, c in b.costs.items()},
            "loads": {w: float(b.spec.workloads[w].load) for w in b.wls}, "calibrate": int(b.spec.calibrate),
            "replica_pool_tokens": b.pool_tokens}


def agreement(rows: list[dict]) -> dict:
    """Per metric, over the fleet's runs (every router policy on every workload): Spearman rank correlation and
    median relative error of the simulated runs against the measured; the one-server runs' errors apart."""
    out = {}
    for m in ("ttft_p99_s", "ttft_p50_s", "throughput_tps"):
        fleet = [r for r in rows if r["router"]]
        real, sim = (np.array([r[k] for r in fleet], float) for k in (m, f"sim_{m}"))
        out[m] = {"spearman": float(spearmanr(real, sim).statistic),
                  "median_rel_error": float(np.median(np.abs(sim / real - 1))),
                  "one_server_rel_errors": [r[f"sim_{m}"] / r[m] - 1 for r in rows if not r["router"]]}
    return out
