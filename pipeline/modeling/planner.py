"""Fleets sized on a virtual clock, computed (never measured): a model on a GPU's spec sheet (its roofline), copies of
the real engine behind a router (pipeline.modeling.fleet), a workload at a request rate.

Capacity, as Vidur-Search and DistServe define it: the highest request rate (req/s, Poisson arrivals of the same
requests, spaced wider or closer; a run's arrivals span at least `seconds`) at which a run meets the SLO (at least
`share` of the requests complete within the TTFT and TPOT limits), by bisection below the compute bound to
`tolerance`. The planner: for each configuration (router, prefill
and decode together or apart, the engine's max_running and token budget), the fewest GPUs whose fleet meets the SLO
at the rate: the count one replica's capacity suggests, simulated, then one replica more until it meets and one
fewer while it still does.
"""
import math
from dataclasses import dataclass, replace

import pandas as pd
from omegaconf import OmegaConf

from engine.router import RouterSpec
from pipeline.config import compose_config, policy_spec
from pipeline.modeling.batch import chunk_step, paged_pool
from pipeline.modeling.fleet import Split, simulate_fleet
from pipeline.modeling.machines import kv_tokens, spec_roofline
from pipeline.modeling.roofline import GB
from pipeline.modeling.simulation import full_batch_decode
from pipeline.workloads.generate import build

VOCAB = 50000    # token ids of computed workloads are drawn below this
CONTEXT = 32768  # tokens one request may hold (prompt + output)


def smallest(prefill_share: float | None) -> int:
    """The fewest replicas a layout can have: 1 colocated; apart, enough for the share (1P3D for 0.25)."""
    s = prefill_share
    return 1 if s is None else max(2, round(1 / min(s, 1 - s)))


@dataclass(frozen=True)
class Fleet:
    """One configuration: `replicas` engines (tp GPUs each), prefilling apart on `prefill_share` of them (None:
    colocated), the router's policy, the chunked-prefill engine's knobs."""
    replicas: int
    router: str = "least_loaded"
    prefill_share: float | None = None
    max_running: int = 256
    token_budget: int = 2048

    def __post_init__(self):
        if self.prefill_share is not None and not 0 < self.prefill_share < 1:
            raise ValueError(f"prefill_share {self.prefill_share} must lie strictly between 0 and 1")
        if self.replicas < smallest(self.prefill_share) or self.max_running < 1 or self.token_budget < 1:
            raise ValueError(f"a fleet of {self.replicas} replica(s) ({self.layout}), max_running "
                             f"{self.max_running}, token budget {self.token_budget}: it needs {self.smallest} "
                             "replicas at least, knobs >= 1")

    @property
    def parts(self) -> tuple[int, int] | None:
        """(prefill, decode) replicas when apart, else None."""
        if self.prefill_share is None:
            return None
        p = min(self.replicas - 1, max(1, round(self.replicas * self.prefill_share)))
        return p, self.replicas - p

    @property
    def smallest(self) -> int:
        return smallest(self.prefill_share)

    @property
    def layout(self) -> str:
        return "colocated" if self.prefill_share is None else f"split {self.prefill_share:g} prefill"

    def label(self) -> str:
        parts = self.parts
        return (f"{self.replicas} x colocated" if parts is None else f"{parts[0]}P{parts[1]}D") + \
            f", {self.router}, max_running {self.max_running}, budget {self.token_budget}"


class Setting:
    """What every fleet of one plan shares: the model on the GPU, the K/V room, the SLO, the link, the requests (a
    run's arrivals span at least `seconds`, and it has at least the workload's num_requests)."""

    def __init__(self, cfg, tp: int | None = None, latency_s: float = 1e-3, router_knobs: tuple = (),
                 seconds: float = 10.0):
        self.cfg, self.roof = cfg, spec_roofline(cfg, tp)
        self.kv_tokens = kv_tokens(self.roof, float(cfg.hardware.memory_gb))  # K/V tokens one replica holds
        if self.kv_tokens <= 0:
            raise ValueError(f"{cfg.model.name}'s weights leave no room for K/V on {self.roof.tp} x "
                             f"{cfg.hardware.name}")
        if seconds <= 0 or latency_s < 0:
            raise ValueError(f"seconds={seconds} must be > 0 and latency_s={latency_s} >= 0")
        self.ttft_s, self.tpot_s, self.share = float(cfg.slo.ttft_s), float(cfg.slo.tpot_s), float(cfg.slo.share)
        self.link_bytes_s = float(cfg.hardware.interconnect_gbs) * GB  # prefill -> decode hand-over, bytes per s
        self.latency_s, self.seconds = latency_s, seconds            # s per hand-over besides its bytes; s of arrivals
        self.router_knobs, self.requests = tuple(router_knobs), int(cfg.workload.num_requests)
        self._built: dict[tuple[int, int], pd.DataFrame] = {}

    def gpus(self, fleet: Fleet) -> int:
        return fleet.replicas * self.roof.tp

    def workload(self, rate: float, seed: int | None = None) -> pd.DataFrame:
        """The requests of a run at `rate`: the first max(num_requests, rate x seconds) of a build of num_requests
        x a power of two (builds are kept, so that nearby rates run the same requests)."""
        need = max(self.requests, math.ceil(rate * self.seconds))
        size = self.requests * 2 ** math.ceil(math.log2(need / self.requests))
        seed = int(self.cfg.seed) if seed is None else seed
        if (size, seed) not in self._built:
            self._built[size, seed] = build(OmegaConf.merge(self.cfg, {"seed": seed, "workload": {
                "num_requests": size}}), None, VOCAB)
        return self._built[size, seed].head(need)

    def simulate(self, rate: float, fleet: Fleet, seed: int | None = None, probe: bool = False) -> dict:
        """One run at `rate` req/s over the fleet (the requests of cfg.seed or `seed`): fleet.simulate_fleet's row;
        a probe stops as soon as too many first tokens are late for the SLO to be met (its row is then partial)."""
        wl, parts = self.workload(rate, seed), fleet.parts
        split = parts and Split(*parts, self.link_bytes_s, self.latency_s, self.roof.kv_bytes_per_token())
        policy = policy_spec("chunked", max_running=fleet.max_running, token_budget=fleet.token_budget)
        router = RouterSpec(fleet.router, cache_tokens=int(self.kv_tokens), **dict(self.router_knobs))
        return simulate_fleet(self.roof, policy, wl, unit_s(wl, rate), int(self.cfg.max_request_tokens),
                              self.ttft_s, self.tpot_s, fleet.replicas, router, kv=paged_pool(self.kv_tokens),
                              split=split, most_late=int((1 - self.share) * len(wl)) if probe else None)

    def meets(self, row: dict) -> bool:
        return row["complete"] == row["requests"] and row["slo_met"] >= self.share

    def bound(self, fleet: Fleet) -> float:
        """An upper bound of the fleet's capacity (req/s): its replicas computing 2048-token prompt chunks and
        nothing else, for each request's prompt and output tokens."""
        wl = self.workload(0.0)
        per_token = self.roof.step_time(chunk_step([(2048, 0)])) / 2048
        return fleet.replicas / (per_token * float((wl["prompt_tokens"] + wl["output_tokens"]).mean()))


def unit_s(wl: pd.DataFrame, rate: float) -> float:
    """Seconds per arrival step that bring the workload's requests at `rate` per second on average."""
    span = float(wl["arrival_steps"].max())
    return len(wl) / rate / span if span > 0 else 0.0


def capacity(setting: Setting, fleet: Fleet, tolerance: float = 0.1) -> tuple[float, dict | None]:
    """The highest rate (req/s) at which the fleet meets the SLO, within `tolerance` (relative), and its run:
    bisection below the compute bound; (0, None) if not even a hundredth of it meets."""
    top = setting.bound(fleet)
    lo, hi, best = 0.0, top, None
    row = setting.simulate(hi, fleet, probe=True)
    if setting.meets(row):
        return hi, row
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        if not lo and mid < top / 100:
            return 0.0, None
        row = setting.simulate(mid, fleet, probe=True)
        if setting.meets(row):
            lo, best = mid, row
        else:
            hi = mid
    return lo, best


def fewest(setting: Setting, rate: float, fleet: Fleet, unit_capacity: float,
           most: int = 256) -> tuple[Fleet, dict] | None:
    """The fleet of this configuration with the fewest replicas that meets the SLO at `rate`, and its run; None
    when even `most` replicas do not (or the configuration meets nothing)."""
    if unit_capacity <= 0:
        return None
    n = max(fleet.smallest, math.ceil(rate / unit_capacity * fleet.smallest))
    row = setting.simulate(rate, replace(fleet, replicas=n), probe=True)
    while not setting.meets(row):
        if n >= most:
            return None
        n += 1
        row = setting.simulate(rate, replace(fleet, replicas=n), probe=True)
    while n > fleet.smallest:
        fewer = setting.simulate(rate, replace(fleet, replicas=n - 1), probe=True)
        if not setting.meets(fewer):
            break
        n, row = n - 1, fewer
    return replace(fleet, replicas=n), row


def plan(setting: Setting, rates: list[float], grid: list[Fleet], usd_per_gpu_hour: float) -> list[dict]:
    """Per rate: every configuration of the grid at its fewest GPUs, cheapest first (fewest GPUs, then cost per
    million output tokens), the best one and its check: the best fleet run on the requests of the next seed."""
    units = {f: capacity(setting, f)[0] for f in grid}  # grid: each at its fewest replicas
    out = []
    for rate in rates:
        ranked = []
        for f in grid:
            found = fewest(setting, rate, f, units[f])
            if found is None:
                ranked.append({"config": f.label(), "router": f.router, "layout": f.layout, "gpus": None})
                continue
            best, row = found
            gpus = setting.gpus(best)
            ranked.append({"config": best.label(), "router": f.router, "layout": f.layout, "gpus": gpus,
                           "fleet": vars(best), "capacity_per_gpu": units[f] / setting.gpus(f),
                           "usd_per_m_output_tokens": gpus * usd_per_gpu_hour / 3600 / row["throughput_tps"] * 1e6,
                           **{k: row[k] for k in ("requests", "ttft_p99_s", "tpot_p99_s", "slo_met",
                                                  "throughput_tps")}})
        ranked.sort(key=lambda r: (r["gpus"] is None, r["gpus"] or 0, r.get("usd_per_m_output_tokens", 0)))
        best = ranked[0] if ranked[0]["gpus"] else None
        check = best and setting.simulate(rate, Fleet(**best["fleet"]), int(setting.cfg.seed) + 1)
        out.append({"rate": rate, "ranked": ranked, "best": best,
                    "check": check and {"slo_met": check["slo_met"], "meets": setting.meets(check),
                                        "ttft_p99_s": check["ttft_p99_s"], "tpot_p99_s": check["tpot_p99_s"]}})
    return out


def grid(routers: list[str], splits: list, max_running: list[int], budgets: list[int]) -> list[Fleet]:
    """Every configuration of the planner's axes (a split None: colocated), at its fewest replicas."""
    out = []
    for r in routers:
        RouterSpec(r)  # an unknown policy fails here, naming the valid ones
        out += [Fleet(smallest(s), r, s, m, b) for s in splits for m in max_running for b in budgets]
    return out


def fleet_config(overrides: list[str], requests: int):
    """The composed config of a computed fleet: the GPU profile, bf16, the chat SLO and at least `requests` requests
    a run of the workload at its published lengths (scale 1) within CONTEXT tokens, Poisson arrivals; overrides on
    top."""
    cfg = compose_config(["profile=gpu", "slo=chat", "policy=chunked", "load=poisson", "precision=bf16-cuda",
                          f"max_request_tokens={CONTEXT}", f"workload.num_requests={requests}",
                          "profile.requests_scale=1", *overrides])
    if "scale" in cfg.workload:
        cfg.workload.scale = 1
    return cfg


def replica_guess(setting: Setting) -> float:
    """What one replica decodes (req/s): 16 rows at a time, each for the workload's mean output."""
    wl = setting.workload(0.0)
    return 16 / (setting.roof.step_time(full_batch_decode(16, 64)) * float(wl["output_tokens"].mean()))
